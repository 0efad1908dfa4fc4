"""Step version "fused_v2": `reference.step`'s contract, forward and backward, on the tensor cores.

Version 1 of the fused kernel (`gpu_impl.steps.fused`, kernels/attend_block_v1.cu)
computes in float32 on the FP32 units, a thread per query row. Version 2
(kernels/attend_block_v2.cu, the backward's attend_block_v2_dkdv.cu and
attend_block_v2_dq.cu, what they share in attend_block_v2.cuh; each opens with
what it changes and what that is expected to buy) is FlashAttention-2's dataflow: mma.sync on float16 or
bfloat16 operands with float32 accumulation, 16 query rows per warp, S and P in
registers, the K/V tiles loaded with cp.async into swizzled shared memory and
read with ldmatrix, the G query heads of a key/value head packed in one tile,
every mask of `reference.masks` (windows, documents, padding) from positions.
Like every version it is checked against the readable step before it is timed:
without a GPU by running the same source on the CPU
(tests/support/gpu/emulate_cuda.cpp, tests/gpu/test_fused_v2.py), on a GPU by
`scripts/gpu_check.py` (`bench.gpu_kernel_check`).

    gpu_impl.ring_attention(q, k, v, comm=comm, step="fused_v2")     # float16 CuPy arrays
    reference.steps.get("fused_v2").forward(acc, queries, block, mask=mask, tile_size=None)

Shapes (compute layout, `reference.heads`): q (B, Hkv, c, G, D) float32
pre-scaled (`Queries.scale` says by how much: the kernel takes it off before
rounding q to 16 bits, and puts it back on S in float32), k, v (B, Hkv, ck, D)
float16 or bfloat16 (NumPy's `ml_dtypes.bfloat16`; CuPy has no bfloat16, so a
CuPy caller passes its bits as uint16 to ``TensorCoreStep(kv_format="bfloat16")``),
D = 64 or 128. A CTA holds 16 x WARPS rows (query, head) and visits key tiles
of BN keys; `tile_size` None takes `DEFAULT_CONFIG`, else (tq, tk): tk keys per
tile (16, 32, 64 or 128) and tq queries, so tq * G rows (at most 128).

The tiles the kernel visits are the host's plan (`reference.tiles.classify` at
(tq, BN) queries x keys), so the counts the trace records are the work done.

The backward is two more kernels of the same source (FlashAttention-2's
dataflow: `attend_block_v2_dkdv`, a CTA per key tile accumulating the block's
dK, dV in float32 over the rounds; `attend_block_v2_dq`, a CTA per query tile
accumulating dQ), at `BACKWARD_CONFIG`'s tile unless `tile_size` says
otherwise. They take finite inputs only: a block or query rows holding NaN or
inf (the owner's flag and `BackwardRows.finite`, on the host) go to the
readable step, on K and V as float32. No dropout, either way.
"""

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reference.layouts import array_module
from reference.masks import any_visible, count_visible_pairs
from reference.nonfinite import all_finite, block_finite, converted
from reference.step import ForwardAcc, ReadableStep, Step, StepCounts
from reference.steps import register
from reference.tiles import SKIP, classify, tile_shape

from . import fused

VERSION = 2
KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
HEADER = KERNELS_DIR / f"attend_block_v{VERSION}.cuh"      # what the three kernels share
KERNELS = {name: KERNELS_DIR / f"{name}.cu"                 # entry function -> its source
           for name in (f"attend_block_v{VERSION}", f"attend_block_v{VERSION}_dkdv", f"attend_block_v{VERSION}_dq")}
HEAD_DIMS = (64, 128)
KEY_TILES = (16, 32, 64, 128)          # BN: keys per tile
MAX_WARPS = 8                          # 16 rows each: at most 128 rows per CTA
DEFAULT_CONFIG = {64: (8, 64), 128: (8, 64)}      # head dim -> (warps, BN)
BACKWARD_CONFIG = {64: (4, 64), 128: (4, 64)}     # the backward's: 64 rows x 64 keys
MAX_SHARED_BYTES = 227 * 1024          # dynamic shared memory of one CTA, opted in (sm_90)
INT32_MAX = 2 ** 31 - 1


@dataclass(frozen=True)
class Config:
    """The compile-time sizes of one build of the kernel."""
    head_dim: int
    warps: int
    bn: int
    bf16: bool

    @property
    def rows(self):
        return 16 * self.warps

    @property
    def threads(self):
        return 32 * self.warps

    def queries(self, group):
        """tq: the queries of a CTA, all `group` heads of each (tq * group <= rows)."""
        return self.rows // group

    @property
    def shared_bytes(self):
        """Q, K and V tiles of 16-bit values, the K tile's positions and documents, V's row flags."""
        return (self.rows + 2 * self.bn) * self.head_dim * 2 + self.bn * 12

    @property
    def backward_shared_bytes(self):
        """The backward kernels': Q, dO, K and V tiles, the keys' positions and
        documents, and per row lse, delta and the keys it may see."""
        return (2 * self.rows + 2 * self.bn) * self.head_dim * 2 + self.bn * 8 + self.rows * 20

    @property
    def kv_threads(self):
        """Threads of the dK, dV kernel: a warp per 16 keys."""
        return 2 * self.bn

    def options(self):
        """The -D options that size the kernel; the same for nvcc, NVRTC and the CPU emulation."""
        return ("-std=c++17", f"-DHEAD_DIM={self.head_dim}", f"-DWARPS={self.warps}", f"-DBN={self.bn}",
                f"-DKV_BF16={int(self.bf16)}")


def kernel_config(tile_size, head_dim, group, kv_format="float16", backward=False):
    """The Config for a call (its forward, or its `backward`), or a ValueError saying what fits."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"step 'fused_v2' takes head dims {HEAD_DIMS}, got {head_dim}; use step='v1'")
    if group > 16 * MAX_WARPS:
        raise ValueError(f"step 'fused_v2' holds at most {16 * MAX_WARPS} query heads per key/value head, "
                         f"got {group}; use step='v1'")
    if tile_size is None:
        warps, bn = (BACKWARD_CONFIG if backward else DEFAULT_CONFIG)[head_dim]
        warps = max(warps, math.ceil(group / 16))
    else:
        tq, bn = tile_shape(tile_size)
        warps = math.ceil(tq * group / 16)
        if bn not in KEY_TILES or warps > MAX_WARPS:
            raise ValueError(f"tile_size {(tq, bn)} does not fit step='fused_v2' with {group} query heads per "
                             f"key/value head: keys per tile in {KEY_TILES}, queries x heads <= "
                             f"{16 * MAX_WARPS}; or tile_size=None")
    config = Config(head_dim, warps, bn, kv_format == "bfloat16")
    assert max(config.shared_bytes, config.backward_shared_bytes) <= MAX_SHARED_BYTES
    return config


def kv_format_of(dtype):
    """"float16" or "bfloat16" for a K/V dtype, or a ValueError."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "float16"
    if dtype.name == "bfloat16":
        return "bfloat16"
    raise ValueError(f"step 'fused_v2' takes float16 or bfloat16 K and V, got {dtype}; use step='v1' "
                     "(or 'fused' for float32)")


@dataclass
class Launch:
    """One launch, as host arrays and numbers: what the GPU launch uploads and
    the CPU emulation passes as they are (tests/gpu/test_fused_v2.py)."""
    config: Config
    grid: tuple            # (query tiles, B * Hkv)
    k_pos: np.ndarray      # (ck,) int32
    q_lo: np.ndarray       # (c,) int32: the positions each query may see, clipped to int32
    q_hi: np.ndarray
    q_doc: np.ndarray      # (c,) int32 documents, or (1,) unused
    k_doc: np.ndarray      # (ck,) or (1,)
    kinds: np.ndarray      # (query tiles, key tiles) int8: reference.tiles' SKIP, FULL, MASKED
    has_docs: int
    unscale: np.float32    # q * unscale: q without its scale (1 / scale, or 1 when unknown)
    rescale: np.float32    # S * rescale: the scale back on S, in float32

    def scalars(self, c, ck, group):
        return (np.int32(c), np.int32(ck), np.int32(group), np.int32(self.config.queries(group)),
                np.int32(self.has_docs), self.unscale, self.rescale)


def plan_launch(queries, block, mask, config, kinds):
    """The Launch of one call (positions on the host, checked to fit int32)."""
    q_pos, k_pos = np.asarray(queries.pos, np.int64), np.asarray(block.pos, np.int64)
    if max(q_pos.max(initial=0), k_pos.max(initial=0)) >= INT32_MAX or min(q_pos.min(initial=0),
                                                                          k_pos.min(initial=0)) < 0:
        raise ValueError(f"step 'fused_v2' takes positions in [0, 2**31 - 1), got {q_pos.min(initial=0)} .. "
                         f"{q_pos.max(initial=0)} and {k_pos.min(initial=0)} .. {k_pos.max(initial=0)}")
    lo, hi = mask.key_range(q_pos)                       # reference.masks: the rule, from positions
    empty = hi < lo
    lo, hi = np.clip(lo, -1, INT32_MAX), np.clip(hi, -1, INT32_MAX)
    lo[empty], hi[empty] = 0, -1                         # a padding query sees nothing
    has_docs = mask.segments is not None and mask.spans is None   # else the documents are in lo, hi
    docs = ((mask.doc(q_pos).astype(np.int32), mask.doc(k_pos).astype(np.int32)) if has_docs
            else (np.zeros(1, np.int32), np.zeros(1, np.int32)))
    B, Hkv = queries.q.shape[:2]
    scale = queries.scale
    known = scale is not None and np.isfinite(scale) and scale != 0
    return Launch(config=config, grid=(kinds.shape[0], B * Hkv), k_pos=k_pos.astype(np.int32),
                  q_lo=lo.astype(np.int32), q_hi=hi.astype(np.int32), q_doc=docs[0], k_doc=docs[1],
                  kinds=np.ascontiguousarray(kinds, dtype=np.int8), has_docs=int(has_docs),
                  unscale=np.float32(1.0 / scale if known else 1.0), rescale=np.float32(scale if known else 1.0))


class TensorCoreStep(Step):
    """The forward of one block as one launch of attend_block_v2, the backward
    as one launch of each of its two backward kernels.
    `kv_format`: None reads it from the K/V dtype; "bfloat16" also takes uint16
    arrays as bfloat16 bits (CuPy has no bfloat16 dtype)."""
    name = "fused_v2"
    array_modules = ("cupy",)
    has_backward = True
    takes_masks = True
    reads_float16 = True        # reference.ring hands it float16 blocks as they travel
    dtypes = ("float16",)       # the inputs it is validated for, in the ring ("auto"; reference.steps)

    def __init__(self, kv_format=None):
        if kv_format not in (None, "float16", "bfloat16"):
            raise ValueError(f"kv_format must be None, 'float16' or 'bfloat16', got {kv_format!r}")
        self.kv_format = kv_format

    def refuses(self, call):
        """float16 or bfloat16 inputs, D = 64 or 128, a tile it has (`kernel_config`)."""
        if call.dtype is not None and call.dtype not in ("float16", "bfloat16"):
            return (f"step 'fused_v2' takes float16 or bfloat16 inputs, got {call.dtype}; use step='v1' "
                    "(or 'auto')")
        if call.head_dim is not None:
            try:
                kernel_config(call.tile_size, call.head_dim, call.group or 1)
            except ValueError as e:
                return str(e)
        return None

    def tile(self, tile_size, head_dim):
        """The tile as given; None for None: the kernel's configuration is
        chosen per call, by head dim, head group and pass (`kernel_config`)."""
        return None if tile_size is None else tile_shape(tile_size)

    def forward(self, acc, queries, block, *, tile_size, mask=None, causal=None, progress=None):
        """Plan the tiles from positions and the mask as every step does, at
        the kernel's tile, then launch the kernel over the whole block (queued
        on the GPU: there is no wait between tiles to call `progress` in)."""
        queries, block, mask = self._with_mask(queries, block, mask, causal)
        kv_format = self.kv_format or kv_format_of(block.k.dtype)
        check_launch(acc, queries, block, kv_format)
        B, Hkv, c, G, D = queries.q.shape
        config = kernel_config(tile_size, D, G, kv_format)
        kinds = classify(queries.pos, block.pos, (config.queries(G), config.bn), mask)   # (Tq, Tk)
        acc.seen |= any_visible(queries.pos, block.pos, mask)
        computed = int((kinds != SKIP).sum())
        if computed:                                     # a block no query sees costs nothing more
            self.launch(acc, queries, block, plan_launch(queries, block, mask, config, kinds))
        return StepCounts(tiles_computed=computed, tiles_skipped=int(kinds.size) - computed,
                          pairs=count_visible_pairs(queries.pos, block.pos, mask))

    def backward(self, grads, queries, rows, block, *, tile_size, mask=None, causal=None, progress=None):
        """Plan the tiles at the backward kernels' tile, then launch both over
        the whole block: dK, dV of the block and dQ added to `grads`. A block
        or query rows that hold NaN or inf take the readable step (module docstring)."""
        queries, block, mask = self._with_mask(queries, block, mask, causal)
        kv_format = self.kv_format or kv_format_of(block.k.dtype)
        check_backward_launch(grads, queries, rows, block, kv_format)
        B, Hkv, c, G, D = queries.q.shape
        config = kernel_config(tile_size, D, G, kv_format, backward=True)
        tile = (config.queries(G), config.bn)
        kinds = classify(queries.pos, block.pos, tile, mask)
        computed = int((kinds != SKIP).sum())
        if computed:
            if finite_inputs(queries, rows, block, kv_format):
                self.launch_backward(grads, queries, rows, block, plan_launch(queries, block, mask, config, kinds))
            else:
                ReadableStep().backward(grads, queries, rows, float32_block(block, kv_format), mask=mask,
                                        tile_size=tile)
        return StepCounts(tiles_computed=computed, tiles_skipped=int(kinds.size) - computed,
                          pairs=count_visible_pairs(queries.pos, block.pos, mask))

    def launch(self, acc, queries, block, plan):
        launch_kernel(acc, queries, block, plan)

    def launch_backward(self, grads, queries, rows, block, plan):
        launch_backward_kernels(grads, queries, rows, block, plan)

    @property
    def label(self):
        return self.name if self.kv_format is None else f"{self.name} ({self.kv_format})"


register(TensorCoreStep, auto_for="cupy")       # "auto" on CuPy tries it first (float16 it takes)


def check_launch(acc, queries, block, kv_format):
    """A ValueError unless the arrays are what the kernel indexes (it reads
    them by these shapes, unchecked; `fused.check_arrays`), K and V in `kv_format`."""
    fused.check_arrays("fused_v2", acc, queries, block)
    for name, x in (("k", block.k), ("v", block.v)):
        takes = kv_format_of(x.dtype) == kv_format if x.dtype != np.uint16 else kv_format == "bfloat16"
        if not takes or x.dtype != block.k.dtype or not x.flags.c_contiguous:
            raise ValueError(f"step 'fused_v2' needs C-contiguous {kv_format} k and v of one dtype, "
                             f"got {name} {x.dtype}")
    fused.check_aligned(("q", queries.q), ("k", block.k), ("v", block.v), ("acc.o", acc.o))


def check_backward_launch(grads, queries, rows, block, kv_format):
    """A ValueError unless the arrays are what the backward kernels index: q, k,
    v and positions as the forward's (`check_launch`, with dQ as the output),
    dO as q, lse and delta as its rows, dK and dV as k; float32, C-contiguous."""
    fused.check_aligned(("grads.dq", grads.dq))        # before check_launch, which calls it acc.o
    check_launch(ForwardAcc(grads.dq, rows.lse, rows.delta, None), queries, block, kv_format)
    q, k = queries.q, block.k
    for name, x, shape in (("rows.do", rows.do, q.shape), ("grads.dq", grads.dq, q.shape),
                           ("rows.lse", rows.lse, q.shape[:-1]), ("rows.delta", rows.delta, q.shape[:-1]),
                           ("grads.dk", grads.dk, k.shape), ("grads.dv", grads.dv, k.shape)):
        if tuple(x.shape) != tuple(shape) or x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"step 'fused_v2' needs C-contiguous float32 {name} of shape {tuple(shape)}, "
                             f"got {x.dtype} {tuple(x.shape)}")
    fused.check_aligned(("rows.do", rows.do), ("grads.dk", grads.dk), ("grads.dv", grads.dv))


def finite_inputs(queries, rows, block, kv_format):
    """Whether the backward kernels may take the block: no NaN or inf in q, dO,
    delta (`BackwardRows.finite`, found once) or K, V (the owner's flag, found
    on the values, bfloat16 bits included: `reference.nonfinite.finite`)."""
    xp = array_module(queries.q)
    if rows.finite is None:
        rows.finite = all_finite(xp, queries.q, rows.do, rows.delta)
    return rows.finite and block_finite(xp, block)


def float32_block(block, kv_format):
    """The block with K and V as float32 (from bfloat16 bits where they are
    uint16), its finiteness flag found again on the float32 values."""
    def widen(x):
        if x.dtype == np.uint16:
            return (x.astype(np.uint32) << 16).view(np.float32)
        return x.astype(np.float32)
    return converted(block, widen(block.k), widen(block.v), widened=False)


def kernel_source(names=tuple(KERNELS)):
    """The CUDA source of the kernels `names` (a name, or several: by default
    all three) as one text, the shared header inlined once in place of their
    `#include`: NVRTC compiles a string, and CuPy's kernel cache is keyed by
    it, so a change to the header must change the text."""
    names = (names,) if isinstance(names, str) else names
    include = f'#include "{HEADER.name}"'
    bodies = [KERNELS[name].read_text().replace(include, "") for name in names]
    return HEADER.read_text() + "".join(f"\n// ---- {KERNELS[n].name}\n{b}" for n, b in zip(names, bodies))


@functools.lru_cache(maxsize=None)
def _kernel(config, name=f"attend_block_v{VERSION}"):
    """One kernel of one Config, compiled by NVRTC (or read from CuPy's cache on disk)."""
    import cupy
    kernel = cupy.RawKernel(kernel_source(name), name, options=config.options())
    # above 48 KiB only when opted in
    kernel.max_dynamic_shared_size_bytes = config.shared_bytes if name == f"attend_block_v{VERSION}" \
        else config.backward_shared_bytes
    return kernel


def launch_backward_kernels(grads, queries, rows, block, plan):
    """The backward's two launches: dK, dV (grid (key tiles, B * Hkv), 2 * BN
    threads), then dQ (grid (query tiles, B * Hkv), 32 * WARPS threads), on the
    current stream, with the plan's arrays as the forward's."""
    import cupy
    q = queries.q
    B, Hkv, c, G, D = q.shape
    kept = fused.positions_for(cupy, q.device.id)
    arrays = [kept.get(cupy, x) for x in (plan.k_pos, plan.q_lo, plan.q_hi, plan.q_doc, plan.k_doc, plan.kinds)]
    scalars = plan.scalars(c, block.k.shape[2], G)
    inputs = (q, rows.do, rows.lse, rows.delta, block.k, block.v, *arrays)
    config, shared = plan.config, plan.config.backward_shared_bytes
    _kernel(config, "attend_block_v2_dkdv")((plan.kinds.shape[1], plan.grid[1]), (config.kv_threads,),
                                            (*inputs, grads.dk, grads.dv, *scalars), shared_mem=shared)
    _kernel(config, "attend_block_v2_dq")(plan.grid, (config.threads,), (*inputs, grads.dq, *scalars),
                                          shared_mem=shared)


def launch_kernel(acc, queries, block, plan):
    """One launch: grid (query tiles, B * Hkv), 32 * WARPS threads, the plan's
    arrays uploaded once per distinct content and stream (`fused.positions_for`)."""
    import cupy
    q = queries.q
    B, Hkv, c, G, D = q.shape
    kept = fused.positions_for(cupy, q.device.id)
    arrays = [kept.get(cupy, x) for x in (plan.k_pos, plan.q_lo, plan.q_hi, plan.q_doc, plan.k_doc, plan.kinds)]
    _kernel(plan.config)(plan.grid, (plan.config.threads,), (q, block.k, block.v, *arrays, acc.o, acc.m, acc.l,
                                                             *plan.scalars(c, block.k.shape[2], G)),
                         shared_mem=plan.config.shared_bytes)
