"""Step version "fused": the forward of `reference.step`'s contract as one CUDA kernel.

The readable step (reference/step.py, version 1) runs each tile as a few CuPy array
operations, each a kernel reading and writing the scores through GPU memory.
The fused kernel (kernels/attend_block_v1.cu) keeps each query row in
registers and a tile's keys, values and scores in shared memory, and skips a tile that no
query can see from positions on the GPU (paper, section 2.2.1). Kernels are
numbered like llm.c's dev/cuda versions; each is validated against the plain
step (tests/test_gpu.py: on the GPU, and without one by compiling the same
source for the CPU) before it is timed (bench/gpu_bench.py).

    gpu_impl.ring_attention(q, k, v, comm=comm, step="fused")
    reference.steps.get("fused").forward(acc, queries, block, causal=True, tile_size=None)

The kernel skips the tiles no query can see by itself, from positions on the
GPU; the counts the trace records are the plan's (`reference.step.Step`), for
the same tile shape.

Shapes (compute layout, float32): q (B, Hkv, c, G, D) pre-scaled, k, v
(B, Hkv, ck, D), q_pos (c,), k_pos (ck,) NumPy int. A tile is TQ queries of
one query head by TK keys; the default (64, 32) fits D <= 128 in 48 KiB of
shared memory. Version 1 is correct and simple, not fast: one thread per row,
no tensor cores, no GQA sharing of the K/V tile across the G query heads.
"""

import functools
from pathlib import Path

import numpy as np

from reference.masks import resolve
from reference.step import Step
from reference.tiles import tile_shape

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
        raise ValueError(f"tile_size {(tq, tk)} does not fit step='fused' at head dim {head_dim}: "
                         f"at most {MAX_THREADS} queries and (2*TK*D + TK*TQ)*4 bytes of shared "
                         f"memory <= {MAX_SHARED_BYTES}")
    return tq, tk


def check_dtype(dtype):
    """Version 1 computes in float32: float16 and float32 inputs only."""
    if np.dtype(dtype) not in (np.dtype(np.float16), np.dtype(np.float32)):
        raise ValueError(f"step='fused' computes in float32 and takes float16 or float32 inputs, "
                         f"got {np.dtype(dtype)}; use step='v1' for float64")


@functools.lru_cache(maxsize=None)
def _kernel(head_dim, tq, tk):
    import cupy
    module = cupy.RawModule(code=kernel_source(), options=compile_options(head_dim, (tq, tk)))
    return module.get_function(f"attend_block_v{VERSION}")


class FusedStep(Step):
    """The forward of one block as one kernel launch (forward only)."""
    name = "fused"
    array_modules = ("cupy",)
    has_backward = False

    def tile(self, tile_size, head_dim):
        return fused_tile(tile_size, head_dim)

    def forward(self, acc, queries, block, *, tile_size, mask=None, causal=None):
        """Plan and count as every step does (the kernel skips the same tiles by
        itself), then launch the kernel over the whole block. The kernel knows
        the causal flag only: other masks (`reference.masks`) take step 'v1'."""
        mask = resolve(mask, causal)
        if not mask.plain:
            raise ValueError(f"step 'fused' knows only causal=True/False, got {mask}; use step='v1'")
        counts = super().forward(acc, queries, block, mask=mask, tile_size=tile_size)
        if counts.tiles_computed:
            launch_kernel(acc, queries, block, self.tile(tile_size, queries.q.shape[-1]), mask.causal)
        return counts

    def forward_tiles(self, acc, queries, block, plan):
        """Nothing per tile: `forward` runs every tile of the plan in one launch."""


def launch_kernel(acc, queries, block, tile, causal):
    """One launch: grid (query tiles, G, B * Hkv), TQ threads, one query row each."""
    import cupy
    q, k, v = queries.q, block.k, block.v
    B, Hkv, c, G, D = q.shape
    for name, x in (("q", q), ("k", k), ("v", v), ("acc.o", acc.o), ("acc.m", acc.m), ("acc.l", acc.l)):
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"step 'fused' needs C-contiguous float32 {name}, got {x.dtype}")
    tq, tk = tile
    grid = ((c + tq - 1) // tq, G, B * Hkv)
    _kernel(D, tq, tk)(grid, (tq,), (
        q, k, v, cupy.asarray(queries.pos, dtype=cupy.int64), cupy.asarray(block.pos, dtype=cupy.int64),
        acc.o, acc.m, acc.l, np.int32(c), np.int32(k.shape[2]), np.int32(G), np.int32(bool(causal))))
