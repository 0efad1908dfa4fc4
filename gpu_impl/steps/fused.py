"""Step version "fused": the forward of `reference.step`'s contract as one CUDA kernel.

The readable step (reference/step.py, version 1) runs each tile as a few CuPy array
operations, each a kernel reading and writing the scores through GPU memory.
The fused kernel (kernels/attend_block_v1.cu) keeps each query row in
registers and a tile's keys, values and scores in shared memory, and skips a tile that no
query can see from positions on the GPU (paper, section 2.2.1). Kernels are
numbered like llm.c's dev/cuda versions; each is validated against the plain
step (tests/gpu/test_gpu.py: on the GPU, and without one by compiling the same
source for the CPU) before it is timed (bench/gpu_bench.py).

    gpu_impl.ring_attention(q, k, v, comm=comm, step="fused")
    reference.steps.get("fused").forward(acc, queries, block, causal=True, tile_size=None)   # after import gpu_impl

The kernel skips the tiles no query can see by itself, from positions on the
GPU; the counts the trace records are the plan's (`reference.step.Step`), for
the same tile shape.

Shapes (compute layout): q (B, Hkv, c, G, D) float32 pre-scaled, k, v
(B, Hkv, ck, D) float32 or float16 (read as they travel: a float16 block is
not cast to float32 every round), q_pos (c,), k_pos (ck,) NumPy int, checked
against the arrays before every launch (a wrong length would read out of
bounds). Positions are uploaded once per distinct array and kept on the GPU
(`DevicePositions`): the queries' every round, and each block's in every later
call. A tile is TQ queries of one query head by TK keys; the default (64, 32)
fits D <= 128 in 48 KiB of shared memory (the command line uses it when no
--tile-size is given). The kernel follows reference/step.py's NaN rule, with
float32 subnormals flushed to zero as CuPy compiles kernels (-ftz=true): a
weight below 2^-126 at a visible inf in V gives NaN (0 x inf) where NumPy's
readable step gives inf (the kernel's header says so).
Version 1 is correct and simple, not fast: one thread per row, no tensor
cores, no GQA sharing of the K/V tile across the G query heads. The host's
checks both versions' launches share live here: `check_arrays` (shapes,
dtypes, positions), `check_grid` (CUDA's grid limits), `check_aligned`
(version 2's vector loads).
"""

import functools
from pathlib import Path

import numpy as np

from reference.step import Step, no_progress
from reference.steps import register
from reference.tiles import plan_tile, tile_shape

VERSION = 1
SOURCE = Path(__file__).resolve().parent / "kernels" / f"attend_block_v{VERSION}.cu"
DEFAULT_TILE = (64, 32)        # (TQ queries = threads, TK keys in shared memory)
MAX_THREADS = 1024
MAX_SHARED_BYTES = 48 * 1024   # static shared memory without opting in


def kernel_source():
    return SOURCE.read_text()


def compile_options(head_dim, tile, kv_half=False):
    """The -D options that size the kernel; the same for nvcc and NVRTC."""
    tq, tk = tile
    return ("-std=c++17", f"-DHEAD_DIM={head_dim}", f"-DTQ={tq}", f"-DTK={tk}", f"-DKV_HALF={int(kv_half)}")


def fused_tile(tile_size, head_dim):
    """(TQ, TK) for the kernel, or a ValueError if it cannot be launched."""
    tq, tk = DEFAULT_TILE if tile_size is None else tile_shape(tile_size)
    shared = (2 * tk * head_dim + tk * tq) * 4 + tk * 9 + 8   # Ks, Vs, S (float32), k positions, flags
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
def _kernel(head_dim, tq, tk, kv_half):
    import cupy
    module = cupy.RawModule(code=kernel_source(), options=compile_options(head_dim, (tq, tk), kv_half))
    return module.get_function(f"attend_block_v{VERSION}")


class DevicePositions:
    """Positions on the GPU, uploaded once per distinct array: a NumPy array is
    looked up by its dtype, length and ends, and used only if its contents are
    equal (a cheap host compare, no device sync); at most `size` kept, oldest
    dropped. Integer arrays keep their dtype (int32 bounds and tile kinds of
    version 2); anything else becomes int64."""

    def __init__(self, size=64):
        self.size, self._kept, self.uploads = size, {}, 0

    def get(self, xp, pos):
        pos = np.asarray(pos)
        if pos.dtype not in (np.int8, np.int32, np.int64):
            pos = pos.astype(np.int64)
        key = (pos.dtype.str, pos.size, int(pos.flat[0]), int(pos.flat[-1])) if pos.size else (pos.dtype.str, 0)
        for host, device in self._kept.get(key, ()):
            if np.array_equal(host, pos):
                return device
        if sum(len(v) for v in self._kept.values()) >= self.size:
            self._kept.clear()
        device = xp.asarray(pos)
        self.uploads += 1
        self._kept.setdefault(key, []).append((pos.copy(), device))
        return device


POSITIONS = {}      # (GPU index, stream) -> its DevicePositions


def positions_for(cupy, device_id):
    """The positions kept for the current stream of GPU `device_id`.
    Hazard: an array uploaded on one stream and read by a launch on another
    needs an event between them, and dropping the cache frees arrays that
    kernels queued on its stream may still read (CuPy's pool hands their
    memory out again at once). Kept per stream, upload, launches and the
    pool's reuse of that memory are all in that one stream's order."""
    return POSITIONS.setdefault((device_id, cupy.cuda.get_current_stream().ptr), DevicePositions())


class FusedStep(Step):
    """The forward of one block as one kernel launch (forward only)."""
    name = "fused"
    array_modules = ("cupy",)
    has_backward = False
    takes_masks = False
    reads_float16 = True        # reference.ring hands it float16 blocks as they travel

    def tile(self, tile_size, head_dim):
        return fused_tile(tile_size, head_dim)

    def refuses(self, call):
        """Its dtypes (float16, float32) and tiles that fit its shared memory."""
        try:
            if call.dtype is not None:
                check_dtype(call.dtype)
            if call.head_dim is not None:
                fused_tile(call.tile_size, call.head_dim)
        except ValueError as e:
            return str(e)
        return None

    def forward_tiles(self, acc, queries, block, plan, progress=no_progress):
        """Every tile of the plan in one launch: the kernel finds the plan's
        tiles by itself, from positions on the GPU, and skips the others (it
        knows the causal flag only: `reference.steps.check_step` keeps other
        masks from it). Queued on the GPU: there is no wait between tiles to
        call `progress` in."""
        check_launch(acc, queries, block)
        launch_kernel(acc, queries, block, plan_tile(plan), queries.mask.causal)


register(FusedStep)


def check_launch(acc, queries, block):
    """A ValueError unless the arrays are what the kernel indexes: it reads
    q, k, v, positions and the accumulator by these shapes, unchecked."""
    check_arrays("fused", acc, queries, block)
    for name, x in (("k", block.k), ("v", block.v)):
        if x.dtype not in (np.float32, np.float16) or x.dtype != block.k.dtype or not x.flags.c_contiguous:
            raise ValueError(f"step 'fused' needs C-contiguous k and v, both float32 or both float16, "
                             f"got {name} {x.dtype}")


def check_arrays(step, acc, queries, block):
    """What both fused kernels index unchecked, whatever K, V hold: q (B, Hkv,
    c, G, D), k and v (B, Hkv, ck, D), the accumulator as q, positions of c and
    ck, and float32, C-contiguous q and accumulator. `step` names the kernel
    in the message."""
    q, k, v = queries.q, block.k, block.v
    if q.ndim != 5 or k.ndim != 4:
        raise ValueError(f"step '{step}' needs q (B, Hkv, c, G, D) and k, v (B, Hkv, ck, D), "
                         f"got q {q.shape}, k {k.shape}")
    B, Hkv, c, G, D = q.shape
    want = {"k": (k, (B, Hkv, k.shape[2], D)), "v": (v, k.shape), "acc.o": (acc.o, q.shape),
            "acc.m": (acc.m, q.shape[:-1]), "acc.l": (acc.l, q.shape[:-1])}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"step '{step}': {name} has shape {tuple(x.shape)}, expected {tuple(shape)} "
                             f"(q {tuple(q.shape)})")
    for name, x, length in (("queries.pos", queries.pos, c), ("block.pos", block.pos, k.shape[2])):
        if np.shape(x) != (length,):
            raise ValueError(f"step '{step}': {name} has shape {np.shape(x)}, expected ({length},)")
    for name, x in (("q", q), ("acc.o", acc.o), ("acc.m", acc.m), ("acc.l", acc.l)):
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError(f"step '{step}' needs C-contiguous float32 {name}, got {x.dtype}")
    check_grid(step, B * Hkv, G)


MAX_GRID_YZ = 65535        # CUDA's limit on grid.y and grid.z (grid.x allows 2**31 - 1)


def check_grid(step, groups, G):
    """A ValueError unless the launch's grid fits CUDA's limits: both kernels
    launch a row of CTAs per batch and key/value head (version 1 on grid.z,
    version 2 on grid.y), version 1 a CTA per query head of a group (grid.y)."""
    if groups > MAX_GRID_YZ:
        raise ValueError(f"step '{step}' launches a row of CTAs per batch x key/value head: B * Hkv = {groups} "
                         f"is over CUDA's grid limit of {MAX_GRID_YZ}; split the batch into calls of fewer")
    if G > MAX_GRID_YZ:
        raise ValueError(f"step '{step}' takes at most {MAX_GRID_YZ} query heads per key/value head, got {G}")


# the bytes version 2's loads or stores take at once: float4 loads of q and
# dO rows, cp.async of 16 bytes from K and V rows, float2 stores of O, dQ, dK, dV
ALIGNMENT = {"q": 16, "k": 16, "v": 16, "rows.do": 16, "acc.o": 8, "grads.dq": 8, "grads.dk": 8, "grads.dv": 8}


def address(x):
    """The address of an array's first element, on a GPU or on the host."""
    if hasattr(x, "__cuda_array_interface__"):
        return x.__cuda_array_interface__["data"][0]
    return x.__array_interface__["data"][0]


def check_aligned(*named):
    """A ValueError unless each (name, array), named as in `ALIGNMENT`, starts
    at an address its loads can read: a C-contiguous view at an offset (x[1:]
    of a flat buffer) passes every shape check and faults on the GPU."""
    for name, x in named:
        n = ALIGNMENT[name]
        if address(x) % n:
            raise ValueError(f"step 'fused_v2' reads and writes {name} {n} bytes at a time, but it starts at "
                             f"address {address(x):#x}, not a multiple of {n} (a view at an offset?): pass a copy")


def launch_kernel(acc, queries, block, tile, causal):
    """One launch: grid (query tiles, G, B * Hkv), TQ threads, one query row each."""
    import cupy
    q, k, v = queries.q, block.k, block.v
    B, Hkv, c, G, D = q.shape
    tq, tk = tile
    grid = ((c + tq - 1) // tq, G, B * Hkv)
    positions = positions_for(cupy, q.device.id)
    _kernel(D, tq, tk, k.dtype == np.float16)(grid, (tq,), (
        q, k, v, positions.get(cupy, queries.pos), positions.get(cupy, block.pos),
        acc.o, acc.m, acc.l, np.int32(c), np.int32(k.shape[2]), np.int32(G), np.int32(bool(causal))))
