"""ring_attention and ring_attention_backward on this rank's CuPy shards: mpi_impl's, on a GPU.

The per-device loop (`reference.ring`, Algorithm 1), the step (`reference.step`,
or a fused kernel of `gpu_impl.steps`, ``step="fused"`` or ``"fused_v2"``), the collective checks and the
communication object (`mpi_impl.comm.RingComm`) are mpi_impl's, run with CuPy
arrays. What this module adds is what only a GPU needs: every rank checks that
CuPy finds a GPU and that its arrays are CuPy arrays on one device, all ranks
agree on the transfer path (`gpu_impl.transfer.choose_transfer`), and RingComm
gets the memory object of that path.

    import gpu_impl
    gpu_impl.use_local_device()                        # first: before MPI starts
    from mpi4py import MPI
    import cupy, reference
    comm = MPI.COMM_WORLD
    q, k, v = (cupy.asarray(reference.shard(x, comm.size, "striped")[comm.rank]) for x in (q, k, v))
    out, lse = gpu_impl.ring_attention(q, k, v, comm=comm, layout="striped")

Shapes (this rank's shard, in the layout's local order): q (B, c, Hq, D), k, v
(B, c, Hkv, D), out like q, lse (B, Hq, c), with c = S // N.
"""

import functools
from typing import NamedTuple

import mpi_impl
from mpi_impl import agree
from mpi_impl.comm import RingComm

from .device import CupyDevice, require_cupy, use_local_device
from .transfer import choose_transfer, memory_for


def ring_attention(q, k, v, *, comm, layout="striped", causal=True, scale=None, tile_size=None,
                   transfer="auto", step="auto", trace=False, seq_len=None, **mask_options):
    """Exact attention of this rank's query shard to every rank's keys:
    `mpi_impl.ring_attention` on CuPy arrays. Returns (out, lse), and the trace
    as mpi_impl does for ``trace=True`` or ``"rank"``. `transfer`: "auto" (ask
    MPI), "staged", "cuda-aware" or "cuda-aware-unchecked"; `step`: "auto"
    (float16: "fused_v2" where it takes the call, else "v1"), "v1", "fused",
    "fused_v2" or a `reference.step.Step`; `seq_len`, the mask options (window,
    cu_seqlens, segment_ids, dropout, seed) and ``scheme=``, ``ulysses_degree=``,
    ``ring_inner=`` (`reference.schemes`: the all-to-all and the double ring's
    three rings take the transfer path too) as in mpi_impl. Collective."""
    device, make_ring = _gpu_ring(comm, (q, k, v), (), transfer=transfer)
    with device:
        return mpi_impl.ring_attention(q, k, v, comm=comm, layout=layout, causal=causal, scale=scale,
                                       tile_size=tile_size, step=step, trace=trace, make_ring=make_ring,
                                       seq_len=seq_len, **mask_options)


def ring_attention_backward(q, k, v, out, lse, dout, *, comm, layout="striped", causal=True,
                            scale=None, tile_size=None, transfer="auto", step="auto", trace=False,
                            seq_len=None, **mask_options):
    """Gradients (dq, dk, dv) of this rank's shard: `mpi_impl.ring_attention_backward`
    on CuPy arrays; options as `ring_attention` (a step with a backward). Collective."""
    device, make_ring = _gpu_ring(comm, (q, k, v), (out, lse, dout), transfer=transfer)
    with device:
        return mpi_impl.ring_attention_backward(q, k, v, out, lse, dout, comm=comm, layout=layout,
                                                causal=causal, scale=scale, tile_size=tile_size, step=step,
                                                trace=trace, make_ring=make_ring, seq_len=seq_len,
                                                **mask_options)


class GpuPath(NamedTuple):
    """What a rank found of its GPU: CuPy, and the transfer path every rank must agree on."""
    cupy: object
    path: str

    def describe(self):
        return dict(transfer=self.path)


def _gpu_ring(comm, qkv, grads, *, transfer):
    """The GPU's checks on every rank, agreed collectively (`mpi_impl.agree`:
    the same clear error everywhere, never a hang); returns (CupyDevice of q,
    the RingComm factory with that path's memory object). The call itself
    (shapes, step, mask) is mpi_impl's to check."""
    def check():
        cupy = require_cupy()
        _check_arrays(cupy, qkv + grads)
        return GpuPath(cupy, choose_transfer(transfer)[0])

    gpu = agree(comm, check)
    device = CupyDevice(gpu.cupy, qkv[0].device.id)
    return device, functools.partial(RingComm.on, memory=memory_for(gpu.path, device))


def _check_arrays(cupy, arrays):
    names = ("q", "k", "v", "out", "lse", "dout")
    for name, x in zip(names, arrays):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a CuPy array (this rank's shard on its GPU), got "
                            f"{type(x).__module__}.{type(x).__name__}; use mpi_impl for NumPy arrays")
        if x.device.id != arrays[0].device.id:
            raise ValueError(f"{name} is on GPU {x.device.id} but q is on GPU {arrays[0].device.id}")


__all__ = ["ring_attention", "ring_attention_backward", "use_local_device"]
