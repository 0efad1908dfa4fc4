"""gpu_impl.steps.fused_v2 at its edges, without a GPU: what the checks on the host and the kernels' masks must catch.

- a last key tile cut short, where every score is strongly negative: the keys
  past the block's end are zeros in shared memory, so exp(0 - lse) overflows
  unless they are masked (dQ, and the forward's out);
- query rows holding NaN (in q or dO) go to the readable step, so that their
  NaN reaches only the keys they see (0 x NaN in the kernels' products would
  reach every key's dK and dV);
- the backward, given no tile, runs at its own tile (`BACKWARD_CONFIG`), not
  the forward's, from the step and from the command line;
- a kernel writing one key past the block fails the emulated launch, naming
  the array (the emulator's guard regions), instead of corrupting memory;
- a grid over CUDA's limit and a misaligned view get clear errors on the host,
  before any launch (v1 and v2).

    .venv/bin/python -m pytest tests/gpu/test_fused_v2_edges.py -q
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import Case
from gpu_impl.steps import fused, fused_v2
from gpu_impl.steps.fused_v2 import Config
from reference.masks import CAUSAL, NOT_CAUSAL
from reference.step import BackwardRows, ForwardAcc, Grads, KVBlock, Queries

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "gpu"))
import emulator  # noqa: E402
from test_fused_v2 import assert_v2_close  # noqa: E402
from test_fused_v2 import readable_and_v2 as forward_readable_and_v2  # noqa: E402
from test_fused_v2_backward import assert_grads_close, readable_and_v2  # noqa: E402

pytestmark = pytest.mark.skipif(emulator.GXX is None, reason="g++ not found")

CONFIG = Config(64, 2, 32, False)           # 32 rows x 32 keys: a block of 40 keys ends in a tile of 8


@pytest.fixture(scope="module")
def step():
    return emulator.EmulatedTensorCoreStep(emulator.build_v2([CONFIG]))


def strongly_negative(case):
    """The case's inputs with every score near -128 (q near 4, k near -4, D = 64,
    scale 1/8): lse near -124, and exp(0 - lse) overflows float32."""
    q, k, v, dout = case.inputs()
    rng = np.random.default_rng(1)
    q = (4 + 0.1 * rng.standard_normal(q.shape)).astype(q.dtype)
    k = (-4 + 0.1 * rng.standard_normal(k.shape)).astype(k.dtype)
    return q, k, v, dout


def test_a_ragged_last_key_tile_is_masked_where_lse_is_strongly_negative(step):
    """40 keys in tiles of 32, every tile full (no causal mask): the last
    tile's 24 missing keys must be masked as hidden pairs in every kernel, or
    dQ (and the forward's out) is NaN."""
    case = Case(layout="contiguous", n_devices=1, B=1, S=40, Hq=2, Hkv=1, D=64, tile_size=None, causal=False,
                scale=None, dtype=np.float16, kind="gaussian", seed=4)
    inputs = strongly_negative(case)
    want, got = readable_and_v2(step, CONFIG, case, mask=NOT_CAUSAL, inputs=inputs)
    assert_grads_close(got, want, case, "a ragged last key tile at lse -124")
    want, got, _ = forward_readable_and_v2(step, CONFIG, case, mask=NOT_CAUSAL, inputs=inputs)
    assert_v2_close(got, want, case, "a ragged last key tile at lse -124")


@pytest.mark.parametrize("where", ["q", "dout"])
def test_query_rows_holding_nan_reach_only_the_keys_they_see(step, where, monkeypatch):
    """A NaN in one query row of q (or of dO), causal: that row's dQ is NaN,
    and the dK, dV of the keys it sees, exactly as the readable step has them;
    the keys after its position stay finite. The rows are not finite, so no
    kernel is launched: P = 0 at a hidden pair does not stop 0 x NaN in the
    tensor cores' dV += P^T dO and dK += dS^T Q."""
    case = Case(layout="striped", n_devices=2, B=1, S=64, Hq=2, Hkv=1, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=5)
    q, k, v, dout = (x.copy() for x in case.inputs())
    (q if where == "q" else dout)[0, 4, 1, 7] = np.nan         # token 4: device 0's third query, head 1
    launched = []
    real = step.launch_backward
    monkeypatch.setattr(step, "launch_backward", lambda *a: (launched.append(1), real(*a)))
    want, got = readable_and_v2(step, CONFIG, case, inputs=(q, k, v, dout))
    assert launched == []
    for name, g, w in (("dq", [got[0]], [want[0]]), ("dk", got[1], want[1]), ("dv", got[2], want[2])):
        for j, (a, b) in enumerate(zip(g, w)):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"NaN of {name}, block {j}")
            seen = ~np.isnan(b)
            np.testing.assert_allclose(a[seen], b[seen], rtol=1e-5, atol=1e-5, err_msg=f"{name}, block {j}")
    dk1 = got[1][1]                                             # device 1's keys 1, 3, .., 63 (compute layout)
    assert np.isnan(dk1[0, 0, :2]).any() and np.isfinite(dk1[0, 0, 2:]).all()     # keys 1, 3 see it; 5.. do not


def test_the_backward_runs_at_its_own_tile_when_none_is_given(monkeypatch):
    """tile_size None: the forward launches at DEFAULT_CONFIG's tile, the
    backward at BACKWARD_CONFIG's (its kernels hold twice the tiles in shared
    memory and are tuned apart); from gpu_impl's command line too, where no
    --backward-tile-size leaves the backward's tile to the step."""
    from gpu_impl.__main__ import parse
    from mpi_impl.plan import backward_tile
    launched = []
    step = fused_v2.TensorCoreStep()
    monkeypatch.setattr(step, "launch", lambda acc, queries, block, plan: launched.append(("forward", plan.config)))
    monkeypatch.setattr(step, "launch_backward", lambda g, q, r, b, plan: launched.append(("backward", plan.config)))
    rng = np.random.default_rng(0)
    for d in fused_v2.HEAD_DIMS:
        queries = Queries.prepare(rng.standard_normal((1, 96, 4, d)).astype(np.float32), 2, np.arange(96), d ** -0.5)
        k, v = (rng.standard_normal((1, 2, 96, d)).astype(np.float16) for _ in range(2))
        block = KVBlock(k, v, np.arange(96), np.array([0, 1], np.int32))
        step.forward(ForwardAcc.zeros(queries.q), queries, block, mask=CAUSAL, tile_size=None)
        rows = BackwardRows(queries.q.copy(), np.zeros(queries.q.shape[:-1], np.float32),
                            np.zeros(queries.q.shape[:-1], np.float32), finite=True)
        grads = Grads(np.zeros_like(queries.q), np.zeros(k.shape, np.float32), np.zeros(k.shape, np.float32))
        step.backward(grads, queries, rows, block, mask=CAUSAL, tile_size=None)
        assert launched[-2:] == [("forward", Config(d, *fused_v2.DEFAULT_CONFIG[d], False)),
                                 ("backward", Config(d, *fused_v2.BACKWARD_CONFIG[d], False))], launched
    assert fused_v2.BACKWARD_CONFIG != fused_v2.DEFAULT_CONFIG
    for argv in (["--step", "fused_v2", "--backward"], ["--backward"]):
        args = parse(argv)[1]
        assert backward_tile(args) == args.tile_size and (args.step != "fused_v2" or args.tile_size is None)


def test_a_write_past_the_block_fails_the_launch_naming_the_array():
    """dK, dV written one key past the block (a `>` for `>=` at the end of the
    dK, dV kernel), in a block of 40 keys whose last tile holds 8: the
    emulator's guard past dk's end changes, and the launch fails saying so."""
    source = fused_v2.kernel_source()
    old = "        if (t >= nk)\n            continue;\n        const long long key = bh * ck + k0 + t;"
    assert source.count(old) == 1
    lib = emulator.build(source.replace(old, old.replace("t >= nk", "t > nk")), CONFIG.options(), 2,
                         optimize=False)
    planted = emulator.EmulatedTensorCoreStep({CONFIG: lib})
    case = Case(layout="contiguous", n_devices=1, B=1, S=40, Hq=2, Hkv=1, D=64, tile_size=None, causal=True,
                scale=None, dtype=np.float16, kind="gaussian", seed=6)
    with pytest.raises(emulator.EmulatorError, match=r"attend_block_v2_dkdv wrote dk past its end"):
        readable_and_v2(planted, CONFIG, case)


def small_call(group=2, kv_dtype=np.float16, B=1, Hkv=1, c=8, d=64):
    """(acc, queries, block) of zeros: q (B, Hkv, c, group, d), K and V (B, Hkv, c, d)."""
    queries = Queries(np.zeros((B, Hkv, c, group, d), np.float32), np.arange(c), scale=d ** -0.5)
    block = KVBlock(*(np.zeros((B, Hkv, c, d), kv_dtype) for _ in range(2)), np.arange(c), np.array([0, 1], np.int32))
    return ForwardAcc.zeros(queries.q), queries, block


def misaligned(x, elements=1):
    """A C-contiguous view of x's values starting `elements` past an aligned buffer's start."""
    flat = np.zeros(x.size + 16, x.dtype)
    view = flat[elements:elements + x.size].reshape(x.shape)
    view[...] = x
    return view


# the bytes the kernels read or write at once (float4 rows of q, dO; 16-byte cp.async of K, V; float2 stores),
# written here from the kernels' source, not read from the code under test
WIDTH = {"q": 16, "k": 16, "v": 16, "rows.do": 16, "acc.o": 8, "grads.dq": 8, "grads.dk": 8, "grads.dv": 8}


@pytest.mark.parametrize("name", sorted(WIDTH))
def test_a_misaligned_view_is_refused_before_the_launch(name, monkeypatch):
    """Every array the kernels read or write with vector loads (float4 rows of
    q and dO, 16-byte cp.async of K and V, float2 stores), as a view one
    off an aligned start by half its alignment (8 bytes off q: a check of 8
    would pass it): a ValueError naming it, and no launch."""
    step = fused_v2.TensorCoreStep()
    monkeypatch.setattr(step, "launch", lambda *a: pytest.fail("launched"))
    monkeypatch.setattr(step, "launch_backward", lambda *a: pytest.fail("launched"))
    acc, queries, block = small_call()
    rows = BackwardRows(queries.q.copy(), acc.m.copy(), acc.l.copy(), finite=True)
    grads = Grads(np.zeros_like(queries.q), np.zeros(block.k.shape, np.float32), np.zeros(block.k.shape, np.float32))
    holder, field = {"q": (queries, "q"), "k": (block, "k"), "v": (block, "v"), "acc.o": (acc, "o"),
                     "rows.do": (rows, "do"), "grads.dq": (grads, "dq"), "grads.dk": (grads, "dk"),
                     "grads.dv": (grads, "dv")}[name]
    x = getattr(holder, field)
    half = misaligned(x, elements=max(1, WIDTH[name] // 2 // x.itemsize))
    if holder is block:                                         # a named tuple
        block = block._replace(**{field: half})
    else:
        setattr(holder, field, half)
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')} .* not a multiple of"):
        if name in ("q", "k", "v", "acc.o"):
            step.forward(acc, queries, block, mask=CAUSAL, tile_size=None)
        else:
            step.backward(grads, queries, rows, block, mask=CAUSAL, tile_size=None)


@pytest.mark.parametrize("version", ["fused", "fused_v2"])
def test_a_grid_over_cudas_limit_is_refused_before_the_launch(version, monkeypatch):
    """B * Hkv = 65,536 rows of CTAs (grid.y of version 2, grid.z of version
    1; CUDA allows 65,535): a ValueError saying to split the batch, before any
    launch; 65,535 passes the check."""
    step = fused.FusedStep() if version == "fused" else fused_v2.TensorCoreStep()
    launched = []
    monkeypatch.setattr(fused if version == "fused" else step, "launch_kernel" if version == "fused" else "launch",
                        lambda *a: launched.append(1))
    kv = np.float32 if version == "fused" else np.float16
    for B, ok in ((65536, False), (65535, True)):
        acc, queries, block = small_call(kv_dtype=kv, B=B, c=2)
        if ok:
            step.forward(acc, queries, block, causal=True, tile_size=None)
        else:
            with pytest.raises(ValueError, match=r"B \* Hkv = 65536 is over CUDA's grid limit of 65535"):
                step.forward(acc, queries, block, causal=True, tile_size=None)
    assert launched == [1]
