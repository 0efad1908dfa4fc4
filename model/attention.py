"""Attention for the model: the one layer that needs the other devices' tokens.

Three interchangeable backends with the same two calls on THIS device's tokens
(in the layout's local order):

    out, lse = attn.forward(q, k, v)                    # q, k, v (B, c, H, D)
    dq, dk, dv = attn.backward(q, k, v, out, lse, dout)

- `Dense`: the whole sequence in natural order on one process, `reference.attention`:
  the oracle the others are checked against.
- `VirtualRing`: N virtual devices in this process, `reference.ring_attention`. The model
  holds the N shards side by side (their concatenation, in the layout's order); a
  token-local layer on that concatenation is the same layer on every shard. Only here,
  at attention, are they handed to the ring, which takes natural order: the shards are
  put back in order for the call and cut again after it.
- `MPIRing`: this rank's shard on real processes, `mpi_impl.ring_attention`.

Masks come from the positions of the layout inside the ring, so a backend needs only
the layout's name. Each backend adds the wall time of its calls to `seconds` and this
process's CPU time in them to `cpu_seconds` (on a shared machine, the time it would
take with a core to itself; MPI ranks spin while they wait, so waiting counts).
"""

import time

import numpy as np

import reference


class Dense:
    """The whole causal sequence, natural order, one process."""

    def __init__(self, *, causal=True):
        self.causal, self.seconds, self.cpu_seconds = causal, 0.0, 0.0

    def forward(self, q, k, v):
        return self._timed(reference.attention, q, k, v, causal=self.causal)

    def backward(self, q, k, v, out, lse, dout):
        return self._timed(reference.attention_backward, q, k, v, out, lse, dout, causal=self.causal)

    def _timed(self, fn, *args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        result = fn(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu
        return result


class VirtualRing(Dense):
    """N virtual devices; takes and returns the N shards side by side (B, N*c, H, D)."""

    def __init__(self, n_devices, layout="striped", *, tile_size=None, causal=True):
        super().__init__(causal=causal)
        self.n, self.layout, self.tile_size = n_devices, layout, tile_size

    def _natural(self, x, axis=1):
        return reference.unshard(np.split(x, self.n, axis=axis), self.layout, axis=axis)

    def _sharded(self, x, axis=1):
        return np.concatenate(reference.shard(x, self.n, self.layout, axis=axis), axis=axis)

    def forward(self, q, k, v):
        opts = dict(n_devices=self.n, layout=self.layout, tile_size=self.tile_size, causal=self.causal)
        out, lse = self._timed(reference.ring_attention, *map(self._natural, (q, k, v)), **opts)
        return self._sharded(out), self._sharded(lse, axis=2)

    def backward(self, q, k, v, out, lse, dout):
        opts = dict(n_devices=self.n, layout=self.layout, tile_size=self.tile_size, causal=self.causal)
        q, k, v, out, dout = map(self._natural, (q, k, v, out, dout))
        grads = self._timed(reference.ring_attention_backward, q, k, v, out,
                            self._natural(lse, axis=2), dout, **opts)
        return tuple(map(self._sharded, grads))


class MPIRing(Dense):
    """This rank's shard; every rank of `comm` calls forward and backward together."""

    def __init__(self, comm, layout="striped", *, tile_size=None, causal=True):
        super().__init__(causal=causal)
        import mpi_impl                          # only here: importing it starts MPI
        self._mpi = mpi_impl
        self.comm, self.layout, self.tile_size = comm, layout, tile_size

    def forward(self, q, k, v):
        return self._timed(self._mpi.ring_attention, q, k, v, comm=self.comm, layout=self.layout,
                           tile_size=self.tile_size, causal=self.causal)

    def backward(self, q, k, v, out, lse, dout):
        return self._timed(self._mpi.ring_attention_backward, q, k, v, out, lse, dout, comm=self.comm,
                           layout=self.layout, tile_size=self.tile_size, causal=self.causal)
