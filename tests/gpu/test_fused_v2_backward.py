"""gpu_impl.steps.fused_v2's backward (attend_block_v2_dkdv and attend_block_v2_dq) without a GPU.

The kernels' CUDA source runs on the CPU (tests/support/gpu/emulate_cuda.cpp:
warp-level operations in the hardware's fragment layouts, cp.async landing as
late as allowed, float32 flushed below 2^-126 as CuPy compiles kernels), and
every block of a ring's rounds is checked against the readable step: dQ summed
over the rounds, each block's dK and dV, within the 16-bit type's tolerance
(P and dS are rounded to it as tensor-core operands), for float16 and
bfloat16, every mask but dropout, grouped query heads, D = 64 and 128. Planted
kernel bugs are caught here, as the forward's are in tests/gpu/test_fused_v2.py.
Blocks or rows that hold NaN or inf go to the readable step (checked too).

    .venv/bin/python -m pytest tests/gpu/test_fused_v2_backward.py -q
"""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import BFLOAT16, Case, assert_close, cases
from gpu_impl.steps import fused_v2
from gpu_impl.steps.fused_v2 import Config
from reference import ring
from reference.heads import q_from_heads, rows_from_heads
from reference.layouts import positions, shard
from reference.masks import CAUSAL, make_mask
from reference.ring import own_block
from reference.step import BackwardRows, ForwardAcc, Grads, Queries, ReadableStep, finish_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "gpu"))
import emulator  # noqa: E402
from test_fused_v2 import masks  # noqa: E402

pytestmark = pytest.mark.skipif(emulator.GXX is None, reason="g++ not found")

# Small tiles (several CTAs of each kernel even for short blocks; one warp of
# dK, dV at BN = 16) and the backward's default tiles.
SMALL = [Config(64, 2, 32, False), Config(64, 1, 16, True), Config(128, 2, 32, True), Config(128, 1, 16, False)]
DEFAULTS = [Config(d, *fused_v2.BACKWARD_CONFIG[d], bf16) for d in fused_v2.HEAD_DIMS for bf16 in (False, True)]
CONFIGS = SMALL + DEFAULTS
KV_DTYPES = {False: np.float16, True: BFLOAT16}


@pytest.fixture(scope="session")
def libraries():
    """{Config: emulator library}, compiled two at a time or found from an earlier session."""
    return emulator.build_v2(CONFIGS)


def emulated(libraries, config):
    return emulator.EmulatedTensorCoreStep({config: libraries[config]})


def readable_and_v2(step, config, case, mask=CAUSAL, inputs=None, device=0):
    """The backward of `device`'s queries against every block of the case's
    ring, by the readable step (float32, on K and V cast from their 16-bit
    type) and by `step` at the config's tile (K and V as they travel), from the
    same rows (out and lse of the readable forward). Returns ((dq, [dk], [dv])
    readable, the same of `step`)."""
    q, k, v, dout = case.inputs() if inputs is None else inputs
    n, group = case.n_devices, case.Hq // case.Hkv
    pos = positions(case.S, n, case.layout)
    queries = Queries.prepare(shard(q, n, case.layout)[device], case.Hkv, pos[device], case.scale_value)
    blocks = [own_block(*(shard(x, n, case.layout)[j] for x in (k, v)), pos[j], j) for j in range(n)]
    acc = ForwardAcc.zeros(queries.q)
    with np.errstate(invalid="ignore", over="ignore"):
        for block in blocks:
            ReadableStep().forward(acc, queries, ring.as_dtype(block, np.float32), mask=mask, tile_size=16)
        out, lse = finish_forward(acc)
    rows = BackwardRows.prepare(q_from_heads(out), rows_from_heads(lse), shard(dout, n, case.layout)[device],
                                case.Hkv, np.float32)
    results, start = [], np.random.default_rng(7)
    dq0 = start.standard_normal(queries.q.shape).astype(np.float32)   # grads are added to, not written
    dk0 = [start.standard_normal(b.k.shape).astype(np.float32) for b in blocks]
    for which in (ReadableStep(), step):
        dq, dks, dvs = dq0.copy(), [], []
        for block, d0 in zip(blocks, dk0):
            grads = Grads(dq, d0.copy(), -d0)
            with np.errstate(invalid="ignore", over="ignore"):
                if which is step:
                    step.backward(grads, queries, rows, block, mask=mask, tile_size=(config.queries(group), config.bn))
                else:
                    which.backward(grads, queries, rows, ring.as_dtype(block, np.float32), mask=mask, tile_size=16)
            dks.append(grads.dk)
            dvs.append(grads.dv)
        results.append((dq, dks, dvs))
    return results


def assert_grads_close(got, want, case, what):
    """dQ, and each block's dK and dV, within the 16-bit type's tolerance."""
    for name, g, w in (("dq", [got[0]], [want[0]]), ("dk", got[1], want[1]), ("dv", got[2], want[2])):
        for j, (a, b) in enumerate(zip(g, w)):
            assert np.isfinite(a).all(), f"{name} of block {j} of {what} is not finite"
            assert_close(a, b, case.dtype, f"{name} of block {j} of {what}", factor=case.grad_tolerance_factor)


def v2_cases(kinds=("gaussian", "large_logits")):
    return cases(dtypes=(np.float16,), max_devices=4, max_seq=96, max_group=4, kinds=kinds)


# -- against the readable step ---------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", SMALL, ids=str)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(case=v2_cases())
def test_v2_backward_emulated_matches_the_readable_step(libraries, config, case):
    """Every layout, N, GQA, causal or not, scale; float16 and bfloat16."""
    case = dataclasses.replace(case, D=config.head_dim, dtype=KV_DTYPES[config.bf16])
    want, got = readable_and_v2(emulated(libraries, config), config, case)
    assert_grads_close(got, want, case, case)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", [SMALL[0], SMALL[2]], ids=str)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(case=v2_cases(kinds=("gaussian",)), data=st.data())
def test_v2_backward_emulated_follows_every_mask(libraries, config, case, data):
    """Windows, documents and padding, from positions as the readable step has them."""
    case = dataclasses.replace(case, D=config.head_dim, dtype=KV_DTYPES[config.bf16])
    mask = data.draw(masks(case.S))
    want, got = readable_and_v2(emulated(libraries, config), config, case, mask=mask)
    assert_grads_close(got, want, case, f"{case} {mask}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", DEFAULTS, ids=str)
def test_v2_backward_emulated_at_the_default_tiles(libraries, config):
    """The builds a GPU runs: 3 striped devices of 150 tokens, 8 query heads
    over 2 key/value heads, a partial last tile of queries and of keys, causal
    and a window with documents."""
    case = Case(layout="striped", n_devices=3, B=1, S=450, Hq=8, Hkv=2, D=config.head_dim, tile_size=None,
                causal=True, scale=None, dtype=KV_DTYPES[config.bf16], kind="gaussian", seed=config.head_dim)
    for mask in (CAUSAL, make_mask(causal=True, window=100, cu_seqlens=[0, 200, 450])):
        want, got = readable_and_v2(emulated(libraries, config), config, case, mask=mask, device=1)
        assert_grads_close(got, want, case, f"{config} {mask}")


def test_v2_backward_with_many_query_heads_per_group(libraries):
    """20 query heads on one key/value head: a query tile of 3 queries x 20
    heads, 4 of its 64 rows idle."""
    config = DEFAULTS[0]
    case = Case(layout="zigzag", n_devices=2, B=1, S=64, Hq=20, Hkv=1, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=20)
    want, got = readable_and_v2(emulated(libraries, config), config, case)
    assert_grads_close(got, want, case, f"{config} {case}")


def test_v2_backward_hands_non_finite_blocks_to_the_readable_step(libraries, monkeypatch):
    """A NaN in V of one block, at the last position, which no query of device
    0 sees (its rows stay finite): that block's backward is the readable
    step's, the other block's the kernels'; the NaN reaches nothing."""
    config = SMALL[0]
    case = Case(layout="striped", n_devices=2, B=1, S=64, Hq=2, Hkv=1, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=3)
    q, k, v, dout = case.inputs()
    v = v.copy()
    v[0, 63, 0, 3] = np.nan                             # token 63: device 1's block under striping
    step, launched = emulated(libraries, config), []
    real = step.launch_backward
    monkeypatch.setattr(step, "launch_backward", lambda *a: (launched.append(a[3].source[0]), real(*a)))
    want, got = readable_and_v2(step, config, case, inputs=(q, k, v, dout))
    assert launched == [0]                              # the finite block only
    assert_grads_close(got, want, case, "a NaN in V no query of device 0 sees")


# -- planted bugs: each is caught ---------------------------------------------------------

PLANTS = {
    "the mask ignored in dK, dV": ("const bool hidden = masked && (t >= nk || !sees(RowMask{row_lo[r]",
                                   "const bool hidden = false && (t >= nk || !sees(RowMask{row_lo[r]"),
    "the mask ignored in dQ": ("const bool hidden = masked && (t >= nk || !sees(mask[h], kpos[t], kdoc[t], has_docs));",
                               "const bool hidden = false;"),
    "delta left out of dS^T": ("dp[nt][e] = p * (dp[nt][e] - row_delta[r]);", "dp[nt][e] = p * dp[nt][e];"),
    "dK without the scale Q carried": ("a.x + dk_acc[dt][2 * h] * rescale, a.y + dk_acc[dt][2 * h + 1] * rescale",
                                       "a.x + dk_acc[dt][2 * h], a.y + dk_acc[dt][2 * h + 1]"),
    "dK, dV overwritten, not added to": ("*vd = make_float2(b.x + dv_acc[dt][2 * h], b.y + dv_acc[dt][2 * h + 1]);",
                                         "*vd = make_float2(dv_acc[dt][2 * h], dv_acc[dt][2 * h + 1]);"),
    "no barrier before the next query tile": (
        "        __syncthreads();                                // every warp is done with the last query tile\n",
        ""),
    "K not waited for in dQ": ("        cp_async_commit();\n        cp_async_wait<0>();\n        __syncthreads();\n",
                               "        cp_async_commit();\n        __syncthreads();\n"),
    "the wrong row's lse in dQ": ("row_lse[h] = active[h] ? lse[bh * all_rows + row] : 0.0f;",
                                  "row_lse[h] = active[h] ? lse[bh * all_rows + row / G * G] : 0.0f;"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_backward_bugs_are_caught(plant):
    """Each plant, compiled into the emulator: the comparison with the readable
    step fails (or the emulator reports the launch as broken)."""
    old, new = PLANTS[plant]
    source = fused_v2.kernel_source()
    assert source.count(old) == 1, f"the plant's line is not in the source once: {old!r}"
    config = SMALL[0]
    lib = emulator.build(source.replace(old, new), config.options(), 2, optimize=False)
    step = emulator.EmulatedTensorCoreStep({config: lib})
    case = Case(layout="striped", n_devices=2, B=1, S=96, Hq=4, Hkv=2, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=11)
    mask = make_mask(causal=True, window=40) if "mask" in plant else CAUSAL
    with pytest.raises((AssertionError, emulator.EmulatorError)):
        want, got = readable_and_v2(step, config, case, mask=mask)
        assert_grads_close(got, want, case, plant)
