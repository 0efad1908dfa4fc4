"""The fused block step: `reference.step.attend_block`'s contract as one CUDA kernel.

The plain step (reference/step.py) runs each tile as a few CuPy array
operations, each a kernel reading and writing the scores through GPU memory.
The fused kernel (kernels/attend_block_v1.cu) keeps each query row in
registers and a tile's keys, values and scores in shared memory, and skips a tile that no
query can see from positions on the GPU (paper, section 2.2.1). Kernels are
numbered like llm.c's dev/cuda versions; each is validated against the plain
step (tests/test_gpu.py: on the GPU, and without one by compiling the same
source for the CPU) before it is timed (bench/gpu_bench.py).

    acc = reference.step.ForwardAcc.zeros(q)          # float32, compute layout
    counts = attend_block(acc, q, k, v, q_pos, k_pos, causal=True, tile_size=None)

Shapes (compute layout, float32): q (B, Hkv, c, G, D) pre-scaled, k, v
(B, Hkv, ck, D), q_pos (c,), k_pos (ck,) NumPy int. A tile is TQ queries of
one query head by TK keys; the default (64, 32) fits D <= 128 in 48 KiB of
shared memory. Version 1 is correct and simple, not fast: one thread per row,
no tensor cores, no GQA sharing of the K/V tile across the G query heads.
"""

import functools
from pathlib import Path

import numpy as np

from reference.step import StepCounts
from reference.tiles import count_visible_pairs, tile_plan, tile_shape

KERNELS = ("step", "fused")
VERSION = 1
SOURCE = Path(__file__).resolve().parent / "kernels" / f"attend_block_v{VERSION}.cu"
DEFAULT_TILE = (64, 32)        # (TQ queries = threads, TK keys in shared memory)
MAX_THREADS = 1024
MAX_SHARED_BYTES = 48 * 1024   # static shared memory without opting in


def kernel_source():
    return SOURCE.read_text()


def compile_options(head_dim, tile):
    """The -D options that size the kernel; the same for nvcc and NVRTC."""
    tq, tk = tile
    return ("-std=c++17", f"-DHEAD_DIM={head_dim}", f"-DTQ={tq}", f"-DTK={tk}")


def fused_tile(tile_size, head_dim):
    """(TQ, TK) for the kernel, or a ValueError if it cannot be launched."""
    tq, tk = DEFAULT_TILE if tile_size is None else tile_shape(tile_size)
    shared = (2 * tk * head_dim + tk * tq) * 4 + tk * 8 + 8   # Ks, Vs, S (float32), k positions
    if tq > MAX_THREADS or shared > MAX_SHARED_BYTES:
        raise ValueError(f"tile_size {(tq, tk)} does not fit kernel='fused' at head dim {head_dim}: "
                         f"at most {MAX_THREADS} queries and (2*TK*D + TK*TQ)*4 bytes of shared "
                         f"memory <= {MAX_SHARED_BYTES}")
    return tq, tk


def check_dtype(dtype):
    """Version 1 computes in float32: float16 and float32 inputs only."""
    if np.dtype(dtype) not in (np.dtype(np.float16), np.dtype(np.float32)):
        raise ValueError(f"kernel='fused' computes in float32 and takes float16 or float32 inputs, "
                         f"got {np.dtype(dtype)}; use kernel='step' for float64")


@functools.lru_cache(maxsize=None)
def _kernel(head_dim, tq, tk):
    import cupy
    module = cupy.RawModule(code=kernel_source(), options=compile_options(head_dim, (tq, tk)))
    return module.get_function(f"attend_block_v{VERSION}")


def attend_block(acc, q, k, v, q_pos, k_pos, *, causal, tile_size):
    """Accumulate attention of `q` to one key/value block into `acc` (a
    `reference.step.ForwardAcc`), like `reference.step.attend_block`.
    Returns StepCounts for the kernel's tiles (TQ queries by TK keys)."""
    import cupy
    B, Hkv, c, G, D = q.shape
    ck = k.shape[2]
    for name, x in (("q", q), ("k", k), ("v", v), ("acc.o", acc.o), ("acc.m", acc.m), ("acc.l", acc.l)):
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"fused attend_block needs C-contiguous float32 {name}, got {x.dtype}")
    tq, tk = fused_tile(tile_size, D)
    plan, skipped = tile_plan(q_pos, k_pos, (tq, tk), causal)
    counts = StepCounts(tiles_computed=len(plan), tiles_skipped=skipped,
                        pairs=count_visible_pairs(q_pos, k_pos, causal))
    grid = ((c + tq - 1) // tq, G, B * Hkv)
    _kernel(D, tq, tk)(grid, (tq,), (
        q, k, v, cupy.asarray(q_pos, dtype=cupy.int64), cupy.asarray(k_pos, dtype=cupy.int64),
        acc.o, acc.m, acc.l, np.int32(c), np.int32(ck), np.int32(G), np.int32(bool(causal))))
    return counts
