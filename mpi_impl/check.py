"""--check: the command line's results against the float64 reference, on rank 0.

Rank 0 gathers every rank's shards, puts them back in natural order and
compares them with the reference computed once for the whole run (every
layout attends the same tokens): the dense formula up to DENSE_MAX_SEQ
tokens, beyond it the NumPy ring on one virtual device, whose memory grows
linearly with S (both tested against each other). The reference runs inside
rank 0's share of the cores (`reference.cores`), and prints a progress line
while it works; the other ranks sleep meanwhile (`mpi_impl.cores.wait_quietly`).
An error is scaled by max(1, |reference|); NaN anywhere gives NaN, which fails.

    checker = Checker(args, cli.inputs, cli.mask_options)   # once per run
    errors = checker.errors(layout, comm, backend, out, lse, grads)     # {"out": 2e-07, ...} on rank 0
"""

import sys
import time
from functools import partial

import numpy as np

from reference import attention, attention_backward, cores
from reference import ring_attention as reference_ring
from reference import ring_attention_backward as reference_ring_backward
from reference.layouts import unshard_at
from reference.testing.compare import TOL

DENSE_MAX_SEQ = 2048     # --check uses the dense S x S formula up to here
AXES = (1, 2, 1, 1, 1)   # sequence axis of out, lse, dq, dk, dv
NAMES = ("out", "lse", "dq", "dk", "dv")


def check_tolerance(dtype):
    """--check fails above this error, scaled by max(1, |reference|): the
    project's tolerance table (`reference.testing.TOL`) allows |actual -
    expected| <= atol max(1, |expected|) + rtol |expected|, so atol + rtol."""
    tol = TOL[np.dtype(dtype)]
    return tol.atol + tol.rtol


class Checker:
    """The reference of one run, computed on first use on rank 0 and kept;
    `seconds` and `threads` say what it cost and what it ran with."""

    def __init__(self, args, make_inputs, mask_options):
        self.args, self.make_inputs, self.mask_options = args, make_inputs, mask_options
        self.want, self.seconds, self.threads = None, 0.0, ""

    def reference(self, backward):
        """[out, lse] (and dq, dk, dv) of the whole sequence, float64."""
        if self.want is None or (backward and len(self.want) < 5):
            args, start = self.args, time.perf_counter()
            print(f"check: float64 reference of S={args.seq_len} on rank 0 ({self.describe()}, "
                  f"{cores.blas_threads()} BLAS thread{'s' if cores.blas_threads() != 1 else ''}) ...",
                  file=sys.stderr, flush=True)
            q, k, v, dout = (x.astype(np.float64) for x in self.make_inputs(args, np.arange(args.seq_len)))
            forward, back = reference_functions(args.seq_len)
            opts = dict(causal=args.causal, **self.mask_options(args))
            out, lse = forward(q, k, v, **opts)
            self.want = [out, lse] + (list(back(q, k, v, out, lse, dout, **opts)) if backward else [])
            self.seconds += time.perf_counter() - start
            self.threads = f"{cores.blas_threads()} BLAS thread{'s' if cores.blas_threads() != 1 else ''}"
            print(f"check: reference done in {self.seconds:.1f} s", file=sys.stderr, flush=True)
        return self.want

    def describe(self):
        return "dense formula" if self.args.seq_len <= DENSE_MAX_SEQ else "NumPy ring on one virtual device"

    def errors(self, pos, comm, backend, out, lse, grads):
        """{"out", "lse" (and "dq", "dk", "dv"): scaled error} on rank 0, {} elsewhere,
        `pos` (N, c) the positions of every rank's tokens. Collective."""
        mine = [backend.to_host(x) for x in (out, lse, *(grads or ()))]
        gathered = comm.gather(mine)
        if comm.Get_rank() != 0:
            return {}
        got = [unshard_at([g[i] for g in gathered], pos, self.args.seq_len, axis=AXES[i])
               for i in range(len(mine))]
        want = self.reference(backward=grads is not None)[:2 if grads is None else 5]
        # a result the backend did not return counts as wrong, never as checked
        return {name: scaled_error(got[i], want[i]) if i < len(got) else float("inf")
                for i, name in enumerate(NAMES[:len(want)])}


def reference_functions(seq_len):
    """(forward, backward): the dense formula up to DENSE_MAX_SEQ tokens; beyond,
    where its S x S scores would not fit, the NumPy ring on one virtual device."""
    if seq_len <= DENSE_MAX_SEQ:
        return attention, attention_backward
    return (partial(reference_ring, n_devices=1, layout="contiguous"),
            partial(reference_ring_backward, n_devices=1, layout="contiguous"))


def scaled_error(actual, expected):
    """max |actual - expected| / max(1, max |expected|); NaN anywhere gives NaN,
    and a wrong shape gives inf (never a broadcast)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        return float("inf")
    return float(np.abs(actual - expected).max() / max(1.0, np.abs(expected).max()))
