"""ring_attention and ring_attention_backward on this rank's CuPy shards.

The per-device loop is `reference.ring` (Algorithm 1) and the per-device step
is `reference.step`, both run with CuPy as the array module; what is specific
to GPUs is the communication object (`gpu_impl.transfer.DeviceRing`) and,
optionally, the fused forward kernel (`gpu_impl.fused`, ``step="fused"``).

    from mpi4py import MPI
    import cupy, gpu_impl, reference
    comm = MPI.COMM_WORLD
    gpu_impl.use_local_device(comm)                    # before creating arrays
    q, k, v = (cupy.asarray(reference.shard(x, comm.size, "striped")[comm.rank]) for x in (q, k, v))
    out, lse = gpu_impl.ring_attention(q, k, v, comm=comm, layout="striped")

Shapes (this rank's shard, in the layout's local order): q (B, c, Hq, D), k, v
(B, c, Hkv, D), out like q, lse (B, Hq, c), with c = S // N.
"""


from mpi_impl import agree, gather_trace
from mpi_impl.attention import TRACE_CHOICES, shard_mask
from reference import checks, ring, steps
from reference.layouts import check_layout, positions
from reference.tiles import tile_shape

from . import fused
from .device import CupyDevice, device_for_local_rank, local_rank, require_cupy
from .transfer import DeviceRing, choose_transfer


def use_local_device(comm):
    """Make this rank's GPU current (ranks deal over the node's GPUs by local
    rank); returns its index. Call before creating the arrays."""
    cupy = require_cupy()
    index = device_for_local_rank(local_rank(comm), cupy.cuda.runtime.getDeviceCount())
    cupy.cuda.Device(index).use()
    return index


def ring_attention(q, k, v, *, comm, layout="striped", causal=True, scale=None, tile_size=None,
                   transfer="auto", step="auto", trace=False, seq_len=None, **mask_options):
    """Exact attention of this rank's query shard to every rank's keys.

    Returns (out, lse); with ``trace=True`` also the Trace of every rank
    (collective), with ``trace="rank"`` this rank's RoundLog (as mpi_impl).
    `step`: "auto" (the readable step, v1, on CuPy), "v1", "fused" or a
    `reference.step.Step`. `seq_len` and the mask options (window, cu_seqlens,
    segment_ids, dropout, seed) as in `mpi_impl.ring_attention`.
    Collective: every rank of `comm` must call it."""
    options = dict(layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                   transfer=transfer, step=step, trace=trace, seq_len=seq_len, mask_options=mask_options)
    cupy, scale, step, mask = _agree(comm, (q, k, v), (), options, "forward")
    q_pos = positions(q.shape[1] * comm.Get_size(), comm.Get_size(), layout)[comm.Get_rank()]
    with CupyDevice(cupy, q.device.id) as device, _DupRing(comm, device, transfer) as ring_comm:
        out, lse, log = ring.ring_forward(q, k, v, q_pos, q_pos, ring_comm, mask=mask,
                                          scale=scale, tile_size=tile_size, step=step)
        device.synchronize()
    return (out, lse) + _trace_result(log, comm, trace)


def ring_attention_backward(q, k, v, out, lse, dout, *, comm, layout="striped", causal=True,
                            scale=None, tile_size=None, transfer="auto", step="auto", trace=False,
                            seq_len=None, **mask_options):
    """Gradients (dq, dk, dv) of this rank's shard; K, V, dK, dV travel the
    ring and dK, dV end on the rank that owns those keys. ``step`` (one with a
    backward) and ``trace`` as in `ring_attention`. Collective."""
    options = dict(layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                   transfer=transfer, step=step, trace=trace, seq_len=seq_len, mask_options=mask_options)
    cupy, scale, step, mask = _agree(comm, (q, k, v), (out, lse, dout), options, "backward")
    q_pos = positions(q.shape[1] * comm.Get_size(), comm.Get_size(), layout)[comm.Get_rank()]
    with CupyDevice(cupy, q.device.id) as device, _DupRing(comm, device, transfer) as ring_comm:
        dq, dk, dv, log = ring.ring_backward(q, k, v, out, lse, dout, q_pos, q_pos, ring_comm,
                                             mask=mask, scale=scale, tile_size=tile_size, step=step)
        device.synchronize()
    return (dq, dk, dv) + _trace_result(log, comm, trace)


class _DupRing:
    """A DeviceRing on a duplicate of `comm` (so ring messages never meet the
    caller's), freed on exit."""

    def __init__(self, comm, device, transfer):
        self._dup = comm.Dup()
        self.ring = DeviceRing(self._dup, device, transfer)

    def __enter__(self):
        return self.ring

    def __exit__(self, *exc):
        self._dup.Free()


def _agree(comm, qkv, grads, options, kind):
    """Every rank checks CuPy, the GPU and its inputs, then all agree
    (`mpi_impl.agree`: the same clear error on every rank, never a hang).
    Returns (cupy, scale, Step, Mask)."""
    found = {}

    def describe():
        found["cupy"] = require_cupy()
        return _describe(found["cupy"], comm, qkv, grads, kind=kind, found=found, **options)

    scale = agree(comm, describe)["scale"]
    return found["cupy"], scale, found["step"], found["mask"]


def _describe(cupy, comm, qkv, grads, *, kind, layout, causal, scale, tile_size, transfer, step,
              trace, found, seq_len, mask_options):
    """This rank's checks, before any communication; what every rank must agree on."""
    q, k, v = qkv
    names = ("q", "k", "v", "out", "lse", "dout")
    for name, x in zip(names, qkv + grads):
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a CuPy array (this rank's shard on its GPU), got "
                            f"{type(x).__module__}.{type(x).__name__}; use mpi_impl for NumPy arrays")
        if x.device.id != q.device.id:
            raise ValueError(f"{name} is on GPU {x.device.id} but q is on GPU {q.device.id}")
    if trace not in TRACE_CHOICES or isinstance(trace, int) and not isinstance(trace, bool):
        raise ValueError(f"trace must be one of {TRACE_CHOICES}, got {trace!r}")
    _, c, _, _, D = checks.check_qkv(q, k, v, seq_axis_name="c")
    if grads:
        checks.check_grads_inputs(q, *grads)
    n = comm.Get_size()
    check_layout(layout, c * n, n)
    path, _ = choose_transfer(transfer)
    scale = checks.check_options(layout=layout, causal=causal, scale=scale, tile_size=tile_size,
                                 head_dim=D)
    found["mask"] = mask = shard_mask(c, n, layout, causal, seq_len, mask_options)
    found["step"] = chosen = steps.check_step(step, cupy, backward=kind == "backward", dropout=mask.dropout)
    if chosen.name == "fused":
        fused.check_dtype(q.dtype)
        fused.fused_tile(tile_size, D)
        if not mask.plain:
            raise ValueError(f"step 'fused' knows only causal=True/False, got {mask}; use step='v1' or 'auto'")
    return dict(kind=kind, q=tuple(q.shape), k=tuple(k.shape), dtype=str(q.dtype), layout=layout,
                causal=bool(causal), scale=scale, tile_size=tile_shape(tile_size), transfer=path,
                step=chosen.name, trace=trace, mask=mask.describe())


def _trace_result(log, comm, trace):
    if trace == "rank":
        return (log,)
    return (gather_trace(log, comm),) if trace else ()


__all__ = ["ring_attention", "ring_attention_backward", "use_local_device"]
