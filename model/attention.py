"""Attention for the model: the one layer that needs the other devices' tokens.

Three interchangeable backends with the same two calls on THIS device's tokens
(in the layout's local order):

    out, lse = attn.forward(q, k, v)                    # q, k, v (B, c, H, D)
    dq, dk, dv = attn.backward(q, k, v, out, lse, dout)

- `Dense`: the whole sequence in natural order on one process, `reference.attention`:
  the oracle the others are checked against.
- `VirtualRing`: N virtual devices in this process, the ring of `reference.ring_attention`.
  The model holds the N shards side by side (their concatenation, in the layout's order);
  a token-local layer on that concatenation is the same layer on every shard. Here, at
  attention, each device takes its own shard as it is (`reference.virtual.run_shards`):
  the tokens stay in the layout's order across every call.
- `MPIRing`: this rank's shard on real processes, `mpi_impl.ring_attention`.

Masks come from the positions of the layout inside the ring, so a backend needs only
the layout's name. Each backend adds the wall time of its calls to `seconds` and this
process's CPU time in them to `cpu_seconds` (on a shared machine, the time it would
take with a core to itself; MPI ranks spin while they wait, so waiting counts).
"""

import time

import numpy as np

import reference
from reference.call import check_call
from reference.virtual import run_shards


class Timed:
    """Adds the wall time of its calls to `seconds` and this process's CPU
    time in them to `cpu_seconds` (module docstring)."""

    def __init__(self):
        self.seconds, self.cpu_seconds = 0.0, 0.0

    def _timed(self, fn, *args, **kwargs):
        start, cpu = time.perf_counter(), time.process_time()
        result = fn(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu
        return result


class Dense(Timed):
    """The whole causal sequence, natural order, one process."""

    def __init__(self, *, causal=True):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return self._timed(reference.attention, q, k, v, causal=self.causal)

    def backward(self, q, k, v, out, lse, dout):
        return self._timed(reference.attention_backward, q, k, v, out, lse, dout, causal=self.causal)


class VirtualRing(Timed):
    """N virtual devices; takes and returns the N shards side by side (B, N*c, H, D),
    each in the layout's local order, as the model holds them: the ring runs on
    the shards as they are (`reference.virtual.run_shards`), nothing is put
    back in natural order."""

    def __init__(self, n_devices, layout="striped", *, tile_size=None, causal=True):
        super().__init__()
        self.n, self.layout, self.tile_size, self.causal = n_devices, layout, tile_size, causal

    def forward(self, q, k, v):
        return self._timed(self._ring, q, k, v)

    def backward(self, q, k, v, out, lse, dout):
        return self._timed(self._ring, q, k, v, out, lse, dout)

    def _ring(self, *arrays):
        """q, k, v (and out, lse, dout) side by side -> the ring's results side
        by side: the N shards are views (np.split), checked as one device's."""
        shards = [np.split(x, self.n, axis=self._token_axis(x)) for x in arrays]
        call = check_call(*(s[0] for s in shards[:3]), n_devices=self.n, layout=self.layout, causal=self.causal,
                          tile_size=self.tile_size, step=reference.steps.DEFAULT, per_device=True,
                          grads=tuple(s[0] for s in shards[3:]) or None)
        results, _ = run_shards(call, shards)
        return tuple(np.concatenate(r, axis=self._token_axis(r[0])) for r in results)

    @staticmethod
    def _token_axis(x):
        return 2 if x.ndim == 3 else 1          # lse (B, H, c); the others (B, c, H, D)


class MPIRing(Timed):
    """This rank's shard; every rank of `comm` calls forward and backward together."""

    def __init__(self, comm, layout="striped", *, tile_size=None, causal=True):
        super().__init__()
        import mpi_impl                          # only here: mpi_impl's ring needs mpi4py when it runs
        self._mpi = mpi_impl
        self.comm, self.layout, self.tile_size, self.causal = comm, layout, tile_size, causal

    def forward(self, q, k, v):
        return self._timed(self._mpi.ring_attention, q, k, v, comm=self.comm, layout=self.layout,
                           tile_size=self.tile_size, causal=self.causal)

    def backward(self, q, k, v, out, lse, dout):
        return self._timed(self._mpi.ring_attention_backward, q, k, v, out, lse, dout, comm=self.comm,
                           layout=self.layout, tile_size=self.tile_size, causal=self.causal)
