"""gpu_impl.steps.fused_v2 (kernels/attend_block_v2.cu) without a GPU: its source run
on the CPU against the readable step, and compiled for sm_90 and read.

- The kernel on the CPU (tests/support/gpu/emulate_cuda.cpp: a fiber per CUDA thread,
  mma.sync, ldmatrix and shuffles in their fragment layouts, cp.async landing
  at its wait, subnormals flushed): the readable step's out and lse, block by
  block over a ring's rounds, at D = 64 and 128, float16 and bfloat16 K and V,
  grouped query heads, causal or not, any scale, every mask (windows,
  documents as runs of positions or not, padding), at small tiles and at the
  default tiles; the tiles it visits are the plan's; its ldmatrix reads have no
  bank conflict.
- The NaN rule: the cases it decides, NaN and inf anywhere, and the one case
  that flushing changes (a weight below 2^-126 at an inf in V).
- Bugs planted in the kernel's text each fail these checks: a fragment index
  off by one, a cp.async wait missing, the softmax's rescale dropped, the
  barrier after a wait missing, the swizzle dropped (bank conflicts).
- The emulator itself: its 16-bit conversions are NumPy's and ml_dtypes'; a
  barrier that some threads never reach is an error, not a hang.
- The whole ring (`reference.ring_attention`) with the emulated step on
  float16 inputs against the dense oracle.
- nvcc compiles the kernel for sm_90 at the default tiles: tensor-core
  instructions (HMMA) in its SASS, no spills.

Sizes: a few hundred tokens at most; each build of the emulator is a few
seconds, kept between sessions (tests/support/gpu/emulator.py).

    .venv/bin/python -m pytest tests/gpu/test_fused_v2.py -q
"""

import dataclasses
import re
import shutil
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import gpu_kernel, gpu_kernel_check
from conftest import BFLOAT16, Case, assert_close, cases
from gpu_impl.steps import fused_v2
from gpu_impl.steps.fused_v2 import Config
from reference import attention, ring, ring_attention, steps
from reference.layouts import positions, shard
from reference.masks import CAUSAL, make_mask
from reference.ring import own_block
from reference.step import ForwardAcc, Queries, ReadableStep, finish_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "gpu"))
import emulator  # noqa: E402

pytestmark = pytest.mark.skipif(emulator.GXX is None, reason="g++ not found")

# Builds: small tiles (several CTAs and key tiles even for short blocks; one
# warp and BN = 16 at D = 128) and the default tiles of each head dim.
SMALL = [Config(64, 2, 32, False), Config(64, 2, 32, True), Config(128, 1, 16, True), Config(128, 2, 32, False)]
DEFAULTS = [Config(d, *fused_v2.DEFAULT_CONFIG[d], bf16) for d in fused_v2.HEAD_DIMS for bf16 in (False, True)]
BACKWARD_DEFAULTS = [Config(d, *fused_v2.BACKWARD_CONFIG[d], bf16) for d in fused_v2.HEAD_DIMS
                     for bf16 in (False, True)]
CONFIGS = SMALL + DEFAULTS + BACKWARD_DEFAULTS
KV_DTYPES = {False: np.float16, True: BFLOAT16}


@pytest.fixture(scope="session")
def libraries():
    """{Config: emulator library}: compiled two at a time, or found from an earlier session."""
    return emulator.build_v2(CONFIGS)


def emulated(libraries, config):
    return emulator.EmulatedTensorCoreStep({config: libraries[config]})


def tile_of(config, group):
    return (config.queries(group), config.bn)


def readable_and_v2(step, config, case, mask=CAUSAL, inputs=None, device=0):
    """Every block of the case's ring accumulated into `device`'s queries,
    round after round, by the readable step (float32, on K and V cast from
    their 16-bit type) and by the emulated kernel (K and V as they travel).
    Returns ((out, lse) readable, (out, lse) v2, [counts of v2])."""
    q, k, v, _ = case.inputs() if inputs is None else inputs
    n, group = case.n_devices, case.Hq // case.Hkv
    pos = positions(case.S, n, case.layout)
    scale = case.scale if case.scale is not None else case.D ** -0.5
    queries = Queries.prepare(shard(q, n, case.layout)[device], case.Hkv, pos[device], scale)
    accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
    counts = []
    for j in range(n):
        block = own_block(*(shard(x, n, case.layout)[j] for x in (k, v)), pos[j], j)
        with np.errstate(invalid="ignore", over="ignore"):
            ReadableStep().forward(accs[0], queries, ring.as_dtype(block, np.float32), mask=mask, tile_size=16)
        counts.append(step.forward(accs[1], queries, block, mask=mask, tile_size=tile_of(config, group)))
    with np.errstate(invalid="ignore", divide="ignore"):
        return finish_forward(accs[0]), finish_forward(accs[1]), counts


def assert_v2_close(got, want, case, what):
    """out within the 16-bit type's tolerance, lse within float32's; -inf (a
    row with no visible key) exactly where the readable step has it."""
    (o1, l1), (o0, l0) = got, want
    assert not np.isnan(o1).any() and not np.isnan(l1).any(), f"NaN in {what}"
    assert_close(o1, o0, case.dtype, f"out of {what}", factor=case.tolerance_factor)
    np.testing.assert_array_equal(np.isneginf(l1), np.isneginf(l0), err_msg=f"-inf lse of {what}")
    seen = np.isfinite(l0)
    assert_close(l1[seen], l0[seen], np.float32, f"lse of {what}", factor=case.tolerance_factor)


def v2_cases(**kw):
    return cases(dtypes=(np.float16,), max_devices=4, max_seq=96, max_group=4, **kw)


# -- against the readable step --------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", SMALL, ids=str)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(case=v2_cases())
def test_v2_emulated_matches_the_readable_step(libraries, config, case):
    """Every layout, N, GQA, causal or not, scale, input kind; out within the
    16-bit type's tolerance (P is rounded to it), lse within float32's."""
    case = dataclasses.replace(case, D=config.head_dim, dtype=KV_DTYPES[config.bf16])
    want, got, _ = readable_and_v2(emulated(libraries, config), config, case)
    assert_v2_close(got, want, case, case)


def masks(seq_len):
    """A mask of reference.masks over `seq_len` positions: a window, documents
    (cu_seqlens, or segment ids that are not runs), padding (the real tokens
    fewer than the positions), or all at once; causal or not."""
    @st.composite
    def draw(draw):
        kind = draw(st.sampled_from(["window", "cu_seqlens", "segment_ids", "padding", "all"]))
        real = draw(st.integers(1, seq_len)) if kind in ("padding", "all") else seq_len
        options = dict(causal=draw(st.booleans()), seq_len=real if real < seq_len else None)
        if kind in ("window", "all"):
            options["window"] = draw(st.integers(1, seq_len))
        if kind in ("cu_seqlens", "all"):
            cuts = sorted(draw(st.sets(st.integers(1, real - 1), max_size=4))) if real > 1 else []
            options.update(cu_seqlens=[0, *cuts, real], seq_len=real)
        if kind == "segment_ids":
            options["segment_ids"] = np.asarray(draw(st.lists(st.integers(0, 2), min_size=seq_len,
                                                              max_size=seq_len)))
        return make_mask(**options)
    return draw()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", [SMALL[0], SMALL[2]], ids=str)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(case=v2_cases(), data=st.data())
def test_v2_emulated_follows_every_mask(libraries, config, case, data):
    """Windows, documents and padding, from positions as the readable step has them."""
    case = dataclasses.replace(case, D=config.head_dim, dtype=KV_DTYPES[config.bf16], kind="gaussian")
    mask = data.draw(masks(case.S))
    want, got, _ = readable_and_v2(emulated(libraries, config), config, case, mask=mask)
    assert_v2_close(got, want, case, f"{case} {mask}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", DEFAULTS, ids=str)
def test_v2_emulated_at_the_default_tiles(libraries, config):
    """The builds a GPU runs: 3 striped devices of 200 tokens, 8 query heads
    over 2 key/value heads (CTAs of 32 queries x 4 heads, 7 per group), a
    partial last tile of queries and of keys, causal and a window with documents."""
    case = Case(layout="striped", n_devices=3, B=1, S=600, Hq=8, Hkv=2, D=config.head_dim, tile_size=None,
                causal=True, scale=None, dtype=KV_DTYPES[config.bf16], kind="gaussian", seed=config.head_dim)
    for mask in (CAUSAL, make_mask(causal=True, window=150, cu_seqlens=[0, 250, 600])):
        want, got, _ = readable_and_v2(emulated(libraries, config), config, case, mask=mask, device=1)
        assert_v2_close(got, want, case, f"{config} {mask}")


@pytest.mark.parametrize("config", [DEFAULTS[0], DEFAULTS[3]], ids=str)
def test_v2_emulated_with_many_query_heads_per_group(libraries, config):
    """32 query heads on one key/value head (a CTA holds 4 queries x 32 heads)
    and 5 (25 queries x 5 heads: 3 of its 128 rows idle)."""
    for hq in (32, 5):
        case = Case(layout="zigzag", n_devices=2, B=1, S=96, Hq=hq, Hkv=1, D=config.head_dim, tile_size=None,
                    causal=True, scale=None, dtype=KV_DTYPES[config.bf16], kind="gaussian", seed=hq)
        want, got, _ = readable_and_v2(emulated(libraries, config), config, case)
        assert_v2_close(got, want, case, f"{config} {case}")


def test_v2_visits_the_plan_and_reads_without_bank_conflicts(libraries):
    """The counts are the plan's at the kernel's tile (striped causal: the
    upper tiles of the diagonal block skipped); the kernel's ldmatrix reads
    fall in 8 bank groups per 8x8 matrix."""
    config = SMALL[0]
    step = emulated(libraries, config)
    lib = step.libraries[config]
    case = Case(layout="contiguous", n_devices=2, B=1, S=256, Hq=2, Hkv=1, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=3)
    lib.emu_reset_counters()
    want, got, counts = readable_and_v2(step, config, case, device=1)
    assert_v2_close(got, want, case, case)
    # contiguous, device 1 (queries 128..255): block 0 all visible, block 1 its own diagonal
    tq, bn = tile_of(config, 2)
    assert counts[0].tiles_skipped == 0 and counts[0].tiles_computed == (128 // tq) * (128 // bn)
    assert counts[1].tiles_skipped > 0
    assert lib.emu_warp_ops() > 0 and lib.emu_bank_conflicts() == 0


# -- the NaN rule -----------------------------------------------------------------

def assert_same_nan_rule(got, want, dtype, what):
    """NaN exactly where the readable step has NaN (and inf where it has inf), close elsewhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"NaN of {what}")
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"inf of {what}")
    ok = np.isfinite(want)
    assert_close(got[ok], want[ok], dtype, what)


def test_v2_emulated_follows_the_nan_rule(libraries):
    """The cases the rule decides (reference/step.py), one query row at
    position 9 seeing keys 0..9 on 2 striped devices:
    1. a visible key whose weight underflows to 0 and whose V holds NaN: 0 x NaN = NaN;
    2. a first block whose visible scores are all -inf (K = -inf) with NaN in V,
       then finite keys: exp(-inf) x NaN = NaN, not a row skipped;
    3. NaN in V at keys a row cannot see: nothing (the masked pair adds 0, not 0 x NaN).
    The whole block goes through the kernel's tiles, so the NaN rows sit in
    tiles with finite and masked pairs around them."""
    config = SMALL[0]
    step = emulated(libraries, config)
    case = Case(layout="striped", n_devices=2, B=1, S=32, Hq=1, Hkv=1, D=64, tile_size=None, causal=True,
                scale=1.0, dtype=np.float16, kind="gaussian", seed=0)
    q, k, v, _ = (x.copy() for x in case.inputs())
    underflow = (q.copy(), k.copy(), v.copy(), None)
    underflow[0][0, 9, 0] = 0.0
    underflow[0][0, 9, 0, 0] = 1.0              # query 9: its score is k[..., 0]
    underflow[1][0, :, 0, 0] = 0.0
    underflow[1][0, 0, 0, 0] = 1000.0           # key 0 dominates: exp(0 - 1000) = 0 for the others
    underflow[2][0, 2, 0, 0] = np.nan           # key 2 (visible to query 9) holds NaN
    minus_inf = (q.copy(), k.copy(), v.copy(), None)
    minus_inf[0][0, :, 0] = 1.0
    minus_inf[1][0, 0::2, 0] = -np.inf          # device 0's keys (even positions): scores -inf
    minus_inf[2][0, 0::2, 0, 0] = np.nan
    hidden = (q.copy(), k.copy(), v.copy(), None)
    hidden[2][0, 30, 0, 5] = np.nan             # key 30: only query 30 and 31 see it
    for name, inputs in (("underflow", underflow), ("all -inf block", minus_inf), ("hidden NaN", hidden)):
        for device in (0, 1):
            want, got, _ = readable_and_v2(step, config, case, inputs=inputs, device=device)
            assert device == 0 or np.isnan(want[0]).any() and not np.isnan(want[0]).all(), name
            for a, b, what in ((got[0], want[0], "out"), (got[1], want[1], "lse")):
                assert_same_nan_rule(a, b, case.dtype, f"{what}, {name}, device {device}")


@pytest.mark.timeout(600)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(case=v2_cases(kinds=("gaussian",)),
       specials=st.lists(st.tuples(st.sampled_from("qkv"), st.integers(0, 10**6),
                                   st.sampled_from([np.nan, np.inf, -np.inf])), min_size=1, max_size=3))
def test_v2_emulated_nan_and_inf_reach_what_they_reach(libraries, case, specials):
    config = SMALL[0]
    case = dataclasses.replace(case, D=config.head_dim)
    q, k, v, dout = case.inputs()
    arrays = dict(q=q, k=k, v=v)
    for which, index, value in specials:
        arrays[which].reshape(-1)[index % arrays[which].size] = value
    want, got, _ = readable_and_v2(emulated(libraries, config), config, case, inputs=(q, k, v, dout))
    assert_same_nan_rule(got[0], want[0], case.dtype, f"out of {case}, {specials}")
    assert_same_nan_rule(got[1], want[1], case.dtype, f"lse of {case}, {specials}")


def flush_case(v_at_key_1):
    """One query (position 5) and two keys (0 and 1), D = 64, scale 1:
    scores 0 and -95; V of key 1 is `v_at_key_1` at dimension 0. The weight
    of key 1, exp(-95) = 5.5e-42, is a float32 subnormal."""
    q = np.zeros((1, 1, 1, 64), np.float16)
    q[..., 0] = 1.0
    k = np.zeros((1, 2, 1, 64), np.float16)
    k[0, 1, 0, 0] = -95.0
    v = np.ones((1, 2, 1, 64), np.float16)
    v[0, 1, 0, 0] = v_at_key_1
    return Queries.prepare(q, 1, np.array([5]), 1.0), own_block(k, v, np.array([0, 1]), 0)


def flushed_and_not(launch_with, lib):
    """out[0] of the flush case (V = inf at key 1) with the emulator flushing, and without."""
    outs = []
    for flush in (1, 0):
        lib.emu_flush_to_zero(flush)
        try:
            queries, block = flush_case(np.inf)
            acc = ForwardAcc.zeros(queries.q)
            launch_with(acc, queries, block)
            with np.errstate(invalid="ignore"):
                outs.append(float(finish_forward(acc)[0][0, 0, 0, 0, 0]))
        finally:
            lib.emu_flush_to_zero(1)
    return outs


def test_v2_flushes_subnormals_as_cupy_kernels_do(libraries):
    """CuPy compiles with -ftz=true: the weight 5.5e-42 is 0 on the GPU, and
    0 x inf = NaN, where NumPy's readable step gives 5.5e-42 x inf = inf. The
    emulator flushes as the GPU does; without flushing it gives inf. A finite
    V there is the same either way."""
    config = SMALL[0]
    step = emulated(libraries, config)
    lib = step.libraries[config]
    queries, block = flush_case(np.inf)
    acc = ForwardAcc.zeros(queries.q)
    ReadableStep().forward(acc, queries, ring.as_dtype(block, np.float32), causal=True, tile_size=16)
    assert np.isposinf(finish_forward(acc)[0][0, 0, 0, 0, 0])
    flushed, unflushed = flushed_and_not(
        lambda acc, queries, block: step.forward(acc, queries, block, causal=True, tile_size=tile_of(config, 1)),
        lib)
    assert np.isnan(flushed) and np.isposinf(unflushed)
    queries, block = flush_case(2.0)
    accs = ForwardAcc.zeros(queries.q), ForwardAcc.zeros(queries.q)
    ReadableStep().forward(accs[0], queries, ring.as_dtype(block, np.float32), causal=True, tile_size=16)
    step.forward(accs[1], queries, block, causal=True, tile_size=tile_of(config, 1))
    np.testing.assert_array_equal(finish_forward(accs[1])[0], finish_forward(accs[0])[0])


# -- planted bugs -----------------------------------------------------------------

# (name, what is replaced, by what): each must make the checks above fail
PLANTS = [
    ("fragment index off by one",                # ldmatrix rows of K: row 8 lanes of each matrix shifted
     "(b[2..3])\n                ldmatrix_x4(b, &Ks[np * 16 * CHUNKS + (k_base ^ (2 * kk))]);",
     "(b[2..3])\n                ldmatrix_x4(b, &Ks[np * 16 * CHUNKS + ((k_base + CHUNKS) ^ (2 * kk))]);"),
    ("P's halves swapped in the A operand",      # columns 2t and 2t+1 of rows g+8 exchanged
     "\n            const unsigned pa[4] = {pack_16x2(s[2 * ks][0], s[2 * ks][1]), pack_16x2(s[2 * ks][2], s[2 * ks][3]),",
     "\n            const unsigned pa[4] = {pack_16x2(s[2 * ks][0], s[2 * ks][1]), pack_16x2(s[2 * ks][3], s[2 * ks][2]),"),
    ("the accumulator's column index off",      # the mask applied to the neighbouring column
     "const int t = nt * 8 + 2 * quad + e % 2;", "const int t = nt * 8 + 2 * quad + 1 - e % 2;"),
    ("a cp.async wait missing",                  # V read before it landed
     "        cp_async_wait<0>();                             // this thread's V rows have landed\n", ""),
    ("the barrier after the wait missing",       # every warp reads K rows other warps copied
     "        __syncthreads();                                // everyone's have; every warp is done with V\n",
     ""),
    ("the softmax rescale dropped",              # O and l not scaled by exp(m - m_new)
     "            l_r[h] = l_r[h] * alpha + sum;", "            l_r[h] = l_r[h] + sum;"),
    ("the masked pairs' NaN guard dropped",      # V rows with NaN or inf go through the tensor cores whole
     "const int any_bad = __syncthreads_or(v_non_finite(Vs, bad, tag, nk, tid));",
     "const int any_bad = 0 * __syncthreads_or(v_non_finite(Vs, bad, tag, nk, tid));"),
]


def planted_fails(libraries, name, old, new):
    """True when the kernel with the plant fails a check of this file: out or
    lse off, NaN where there should be none, or an error of the emulator."""
    source = fused_v2.kernel_source()
    assert source.count(old) == 1, f"plant {name!r}: the text to replace is not in the kernel once"
    config = SMALL[0]
    lib = emulator.build(source.replace(old, new), config.options(), 2, optimize=False)
    step = emulator.EmulatedTensorCoreStep({config: lib})
    case = Case(layout="striped", n_devices=2, B=1, S=192, Hq=4, Hkv=2, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=7)
    q, k, v, dout = case.inputs()
    v[0, 3, 1, 2] = np.nan                        # a NaN some rows see and others must not
    try:
        want, got, _ = readable_and_v2(step, config, case, inputs=(q, k, v, dout), device=1)
        assert_same_nan_rule(got[0], want[0], case.dtype, name)
        assert_same_nan_rule(got[1], want[1], case.dtype, name)
    except (AssertionError, emulator.EmulatorError):
        return True
    return False


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, old, new", PLANTS, ids=[p[0] for p in PLANTS])
def test_a_planted_bug_fails_the_checks(libraries, name, old, new):
    assert planted_fails(libraries, name, old, new), f"the plant {name!r} went unnoticed"


def test_dropping_the_swizzle_gives_bank_conflicts(libraries):
    """Rows of 128 bytes unswizzled: an ldmatrix's 8 rows share one bank group."""
    source = fused_v2.kernel_source()
    plain = source.replace("return row * CHUNKS + (chunk ^ (row & 7));", "return row * CHUNKS + chunk;")
    plain = plain.replace("(((lane / 8) % 2) ^ (lane % 8))", "((lane / 8) % 2)").replace(
        "((lane / 16) ^ (lane % 8))", "(lane / 16)")
    config = SMALL[0]
    lib = emulator.build(plain, config.options(), 2, optimize=False)
    step = emulator.EmulatedTensorCoreStep({config: lib})
    case = Case(layout="striped", n_devices=1, B=1, S=64, Hq=2, Hkv=1, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=1)
    step.libraries[config].emu_reset_counters()
    want, got, _ = readable_and_v2(step, config, case)
    assert_v2_close(got, want, case, "unswizzled")          # still right, only slower
    assert step.libraries[config].emu_bank_conflicts() > 0


# -- the emulator itself --------------------------------------------------------------

def test_emulator_conversions_are_numpys(libraries):
    """float32 -> float16 / bfloat16 (round to nearest even, subnormals, overflow
    to inf, NaN) and back, as NumPy and ml_dtypes convert, on every 16-bit
    value and on float32 values around every rounding boundary."""
    rng = np.random.default_rng(0)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 65519.99, 2.0 ** -24,
                         2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -14, 3e38, 1e-40, -1e-45], np.float32)
    every16 = np.arange(2 ** 16, dtype=np.uint16)
    for bf16, dtype in ((False, np.float16), (True, BFLOAT16)):
        lib = emulator.load(libraries[Config(64, 2, 32, bf16)])
        halves = every16.view(dtype).astype(np.float32)
        with np.errstate(invalid="ignore"):
            values = np.concatenate([specials, halves, np.nextafter(halves, np.float32(np.inf)),
                                     np.nextafter(halves, np.float32(-np.inf)),
                                     rng.standard_normal(5000) * 10.0 ** rng.integers(-8, 6, 5000)]).astype(np.float32)
        with np.errstate(over="ignore"):
            want = values.astype(dtype).view(np.uint16)
        got = np.array([lib.emu_pack_16x2(float(x), 0.0) & 0xffff for x in values], np.uint16)
        nan = np.isnan(values)
        np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=f"float32 -> {np.dtype(dtype).name}")
        assert np.isnan(got[nan].view(dtype).astype(np.float32)).all()
        back = np.array([lib.emu_from_16(int(h)) for h in every16], np.float32)
        np.testing.assert_array_equal(back, halves, err_msg=f"{np.dtype(dtype).name} -> float32")


def test_emulator_reports_lanes_at_different_warp_operations(libraries):
    """A shuffle that half of a warp skips hangs a GPU (or reads undefined
    values); the emulator says which lines the lanes are at."""
    source = fused_v2.kernel_source()
    old = "            mx = fmaxf(mx, __shfl_xor_sync(FULL_WARP, mx, 1));"
    assert source.count(old) == 1
    config = SMALL[0]
    lib = emulator.build(source.replace(old, "            if (lane < 16)\n    " + old), config.options(), 2,
                         optimize=False)
    step = emulator.EmulatedTensorCoreStep({config: lib})
    case = Case(layout="striped", n_devices=1, B=1, S=64, Hq=2, Hkv=1, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=1)
    with pytest.raises(emulator.EmulatorError, match="different warp-level operations"):
        readable_and_v2(step, config, case)


# -- the ring, the registry, the checks -------------------------------------------------------

class LockedStep(emulator.EmulatedTensorCoreStep):
    """The emulator runs one launch at a time: virtual devices are threads."""
    _lock = threading.Lock()

    def launch(self, *args):
        with self._lock:
            super().launch(*args)


def test_ring_attention_with_the_emulated_kernel_matches_the_oracle(libraries):
    """reference.ring_attention on 4 virtual devices, float16 inputs, striped,
    a window and documents, each device's step the emulated kernel: the dense
    float64 oracle within float16's tolerance."""
    config = DEFAULTS[0]
    step = LockedStep({config: libraries[config]})
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 256, 4, 64)).astype(np.float16)
    k, v = (rng.standard_normal((1, 256, 2, 64)).astype(np.float16) for _ in range(2))
    options = dict(window=100, cu_seqlens=[0, 70, 256])
    out, lse = ring_attention(q, k, v, n_devices=4, layout="striped", step=step, **options)
    want, want_lse = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), **options)
    assert out.dtype == np.float16
    assert_close(out, want, np.float16, "out")
    assert_close(lse, want_lse, np.float32, "lse")


def test_v2_is_a_registered_step_with_a_backward():
    step = steps.get("fused_v2")
    assert isinstance(step, fused_v2.TensorCoreStep) and step.has_backward and step.takes_masks
    assert not step.has_dropout
    with pytest.raises(ValueError, match="computes with cupy"):
        steps.check_step("fused_v2", np)


def test_auto_picks_v2_for_float16_on_cupy():
    """"auto" on CuPy: the tensor-core kernels where they take the call (float16,
    D = 64 or 128, a tile they have, no dropout), forward and backward, else the readable step."""
    cupy = types.ModuleType("cupy")                     # only its name is read
    f16 = steps.Call("float16", 64, 4, None)
    assert steps.check_step("auto", cupy, call=f16).name == "fused_v2"
    assert steps.check_step("auto", cupy, call=f16, backward=True).name == "fused_v2"
    assert steps.check_step("auto", cupy, call=f16._replace(head_dim=128, tile_size=(32, 64))).name == "fused_v2"
    for call, options in ((f16._replace(dtype="float32"), {}), (f16, dict(dropout=True)),
                          (f16._replace(head_dim=96), {}), (f16._replace(tile_size=1024), {}), (None, {})):
        assert steps.check_step("auto", cupy, call=call, **options).name == "v1", (call, options)
    assert steps.get("auto", xp=cupy).name == "v1"       # nothing known of the call
    assert steps.check_step("auto", np, call=f16).name == "v5"
    with pytest.raises(ValueError, match="does not fit step='fused_v2'"):
        steps.check_step("fused_v2", cupy, call=f16._replace(tile_size=1024))
    with pytest.raises(ValueError, match="takes float16 or bfloat16 inputs"):
        steps.check_step("fused_v2", cupy, call=f16._replace(dtype="float32"))


def test_v2_checks_what_it_is_given():
    q = np.zeros((1, 2, 8, 2, 64), np.float32)
    k = np.zeros((1, 2, 6, 64), np.float16)
    acc = ForwardAcc.zeros(q)
    good = (Queries(q, np.arange(8)), ring.KVBlock(k, k, np.arange(6), np.array([0])))
    fused_v2.check_launch(acc, *good, "float16")
    for bad, kv_format, message in (
            ((Queries(q, np.arange(7)), good[1]), "float16", r"queries.pos has shape \(7,\)"),
            ((good[0], good[1]._replace(v=k[:, :, :5].copy())), "float16", "v has shape"),
            ((good[0], good[1]._replace(v=k.astype(np.float32))), "float16", "float16 or bfloat16"),
            ((good[0], good[1]), "bfloat16", "bfloat16 k and v"),
            ((Queries(q.astype(np.float64), np.arange(8)), good[1]), "float16", "float32 q")):
        with pytest.raises(ValueError, match=message):
            fused_v2.check_launch(acc, *bad, kv_format)
    fused_v2.check_launch(acc, good[0], good[1]._replace(k=k.view(np.uint16), v=k.view(np.uint16)), "bfloat16")
    assert fused_v2.kernel_config(None, 128, 4) == Config(128, 8, 64, False)
    assert fused_v2.kernel_config((8, 32), 64, 3) == Config(64, 2, 32, False)   # 24 rows: 2 warps
    for tile, head_dim, group, message in (((16, 48), 64, 1, "keys per tile"), ((64, 64), 64, 4, "<= 128"),
                                           (None, 96, 1, "head dims"), (None, 64, 200, "at most 128")):
        with pytest.raises(ValueError, match=message):
            fused_v2.kernel_config(tile, head_dim, group)
    with pytest.raises(ValueError, match=r"positions in \[0, 2\*\*31"):
        fused_v2.plan_launch(good[0], good[1]._replace(pos=np.arange(6) + 2 ** 31), CAUSAL,
                             Config(64, 2, 32, False), np.ones((1, 1), np.int8))


class NumpyAsCupy:
    """NumPy in CuPy's place, for the GPU check's Python on the CPU."""
    asarray = staticmethod(np.asarray)
    asnumpy = staticmethod(np.asarray)
    cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(synchronize=lambda: None))


def test_gpu_check_step_runs_on_the_cpu(libraries):
    """bench.gpu_kernel_check's step of make gpu-check with the emulated kernel and
    NumPy as the GPU, at small sizes: its Python has run, and passes, before a
    GPU's time is spent on it."""
    def make(kv_format):
        return emulator.EmulatedTensorCoreStep({c: libraries[c] for c in DEFAULTS + BACKWARD_DEFAULTS},
                                               kv_format=kv_format)
    ok, text = gpu_kernel_check.check_against_readable(NumpyAsCupy, seq=256, make_v2=make)
    assert ok and text.count("| ok |") == 8, text
    ok, text = gpu_kernel_check.backward_against_readable(NumpyAsCupy, seq=256, make_v2=make)
    assert ok and text.count("| ok |") == 8, text
    table = gpu_kernel_check.rates(NumpyAsCupy, c=64, make_v2=make, with_v1=False, launches=1, repeat=1)
    assert table.count("fused v2 (tensor cores)") == 4 and table.count("the kernel alone") == 4, table
    assert table.count("fused v2 backward (two kernels)") == 4, table
    assert table.count("fused v2 backward, the kernels alone") == 4, table
    assert gpu_kernel_check.check(dry=True)[0] and gpu_kernel_check.timings(dry=True)[0]


def test_the_sanitizers_v2_launches_run_on_the_cpu(libraries):
    """make gpu-check's compute-sanitizer step launches version 2 too (D = 128,
    float16 and bfloat16, c not a multiple of the tile, a window, a NaN in V):
    with the emulated kernel, the NaN reaches exactly the rows whose window
    holds its key."""
    def make(kv_format):
        return emulator.EmulatedTensorCoreStep({c: libraries[c] for c in DEFAULTS + BACKWARD_DEFAULTS},
                                               kv_format=kv_format)
    assert gpu_kernel_check.sanitizer_launches(NumpyAsCupy, make_v2=make)


# -- compiled for sm_90 ----------------------------------------------------------------------

NVCC = shutil.which("nvcc")


@pytest.mark.timeout(900)
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("config", DEFAULTS + BACKWARD_DEFAULTS[:1] + BACKWARD_DEFAULTS[2:3], ids=str)
def test_v2_compiles_for_sm90_on_the_tensor_cores(config):
    """nvcc for sm_90, each kernel of the source (the forward, and the
    backward's dK, dV and dQ kernels): no spill at the default tiles; with
    cuobjdump, the SASS of each holds HMMA (the tensor cores), at least its
    products per tile, and LDSM (ldmatrix) and LDGSTS (cp.async), all on
    one pass of the loop that holds them (what bench.gpu_kernel counts)."""
    cubin, report = emulator.nvcc_cubin(fused_v2.kernel_source(), config.options())
    entries = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads",
                         report, re.S)
    assert sorted(name for name, *_ in entries) == ["attend_block_v2", "attend_block_v2_dkdv", "attend_block_v2_dq"]
    assert all(stores == loads == "0" for _, stores, loads in entries), report
    sass = emulator.sass(cubin)
    if sass is None:
        pytest.skip("cuobjdump or nvdisasm not found (the test extra installs them)")
    functions = dict(re.findall(r"Function : (\w+)\n(.*?)(?=Function : |\Z)", sass, re.S))
    d, bn = config.head_dim, config.bn
    products = {"attend_block_v2": 2 * (bn // 8) * (d // 16),               # S = Q K^T, O += P V
                "attend_block_v2_dkdv": 4 * (32 // 8) * (d // 16),          # S^T, dP^T, dV, dK: 32 rows at a time
                "attend_block_v2_dq": 3 * (bn // 8) * (d // 16)}            # S, dP, dQ
    for name, count in products.items():
        assert functions[name].count("HMMA.16816.F32") >= count, f"{name}: fewer tensor-core products than a tile's"
        assert "LDSM" in functions[name] and "LDGSTS" in functions[name], name
        # one pass of the loop holding the products issues them all, and a full tile's exponentials
        needs = {"MUFU": 16} if name.endswith("dkdv") else gpu_kernel.full_tile(config, config.threads)
        total, issued = gpu_kernel.product_loop(gpu_kernel.instructions(functions[name]), needs)
        assert issued is not None and count <= issued <= total, (name, issued, total)
