"""Ring attention on MPI ranks: this rank's shard in, this rank's shard out.

Each rank is one device of the paper's Algorithm 1. The per-device loop is
`reference.ring` (the same code the virtual devices run); this module only adds
what real processes need around it:

1. a collective agreement check: every rank validates its own call
   (`reference.call.check_call`), then all ranks exchange its description
   (shapes, dtypes, options) with one ``allgather``, and every rank raises the
   same clear error if any rank's input is bad or any two ranks differ. Every
   rank reaches the allgather, errors or not, so the check itself cannot hang;
2. a `RingComm` on a duplicate of the caller's communicator;
3. the global positions of this rank's tokens, from the layout
   (`reference.layouts.positions`), since positions travel with the tokens.

    from mpi4py import MPI
    from reference import shard
    comm = MPI.COMM_WORLD
    qs, ks, vs = (shard(x, comm.size, "striped")[comm.rank] for x in (q, k, v))
    out, lse = ring_attention(qs, ks, vs, comm=comm, layout="striped")

Shapes (this rank's shard, in the layout's local order): q (B, c, Hq, D),
k and v (B, c, Hkv, D), out like q, lse (B, Hq, c), with c = S // N.

Mask options (`reference.masks`, the same on every rank): ``window``,
``cu_seqlens`` or ``segment_ids`` (of the whole sequence), ``dropout`` and
``seed``; and ``seq_len``, the real length when the layout padded it
(``shard`` pads to N c tokens; None: S = N c, no padding).
"""

import numpy as np

from reference import ring, schemes
from reference.call import check_call
from reference.trace import Trace

from .comm import RingComm
from .cores import wait_quietly
from .groups import scheme_comms
from .ranks import communicator_name, named_rank

TRACE_CHOICES = (False, True, "rank")


def ring_attention(q, k, v, *, comm, layout="striped", causal=True, scale=None, tile_size=None,
                   step="auto", trace=False, make_ring=RingComm.on, seq_len=None, scheme="ring",
                   ulysses_degree=None, ring_inner=None, call=None, **mask_options):
    """Exact attention of this rank's queries over every rank's keys.

    Returns (out, lse); with ``trace=True`` also the Trace of every rank
    (gathered, collective); with ``trace="rank"`` this rank's RoundLog.
    `step`: a name of `reference.steps` ("auto": the fastest validated step for
    the arrays) or a `reference.step.Step`.
    ``make_ring(comm)`` builds the communication object (another backend passes
    its own), a context manager whose exit ends the ring's transfers and frees
    what it holds however the ring ended, with a list of `transfers` (their
    times, for the trace). `seq_len` and `mask_options`: see the module
    docstring. `scheme`, `ulysses_degree` and `ring_inner`: "ring" (the
    default), "all_gather", "ulysses" or "usp" with u, "double_ring" with w,
    as `reference.ring_attention` takes them; this rank's shard holds the tokens
    `reference.schemes.Scheme.positions` gives it (for u > 1:
    `reference.layouts.ulysses_positions`), and the communicator is split once
    per call (`mpi_impl.groups`). `call`: a `reference.call.RingCall`
    resolved beforehand for this rank's arrays (`reference.call.resolve_call`,
    per_device; the command line's plan), which takes the place of the
    options: the ranks still agree on it.
    Collective: every rank of `comm` must call it."""
    call = agree(comm, lambda: _check(q, k, v, comm, trace, call, layout=layout, causal=causal, scale=scale,
                                      tile_size=tile_size, step=step, seq_len=seq_len, scheme=scheme,
                                      ulysses_degree=ulysses_degree, ring_inner=ring_inner, **mask_options),
                 trace=trace)
    with scheme_comms(comm, call.scheme, make_ring) as comms, named_rank(comm):    # freed however it ends
        out, lse, log = schemes.forward(q, k, v, _group_positions(call, comm), comms, scheme=call.scheme,
                                        scale=call.scale, tile_size=call.tile, step=call.step, mask=call.mask)
    log.add_transfers(comms.ring.transfers, ring.KV)        # when each block arrived, for the trace
    return (out, lse) + _trace_result(log, comm, trace)


def ring_attention_backward(q, k, v, out, lse, dout, *, comm, layout="striped", causal=True,
                            scale=None, tile_size=None, step="auto", trace=False, make_ring=RingComm.on,
                            seq_len=None, scheme="ring", ulysses_degree=None, ring_inner=None, call=None,
                            **mask_options):
    """Gradients (dq, dk, dv) of this rank's shard, from the forward's out and lse.

    K, V, dK, dV travel the ring; dQ stays home; dK, dV end on the rank that
    owns those keys. ``step``, ``trace``, ``make_ring``, the scheme and `call`
    as in `ring_attention`. Collective."""
    call = agree(comm, lambda: _check(q, k, v, comm, trace, call, layout=layout, causal=causal, scale=scale,
                                      tile_size=tile_size, step=step, grads=(out, lse, dout), seq_len=seq_len,
                                      scheme=scheme, ulysses_degree=ulysses_degree, ring_inner=ring_inner,
                                      **mask_options),
                 trace=trace)
    with scheme_comms(comm, call.scheme, make_ring) as comms, named_rank(comm):
        dq, dk, dv, log = schemes.backward(q, k, v, out, lse, dout, _group_positions(call, comm), comms,
                                           scheme=call.scheme, scale=call.scale, tile_size=call.tile,
                                           step=call.step, mask=call.mask)
    log.add_transfers(comms.ring.transfers, ring.KV)
    return (dq, dk, dv) + _trace_result(log, comm, trace)


def _group_positions(call, comm):
    """The positions of this rank's ring rank: its Ulysses group's shards in group order."""
    return np.concatenate([call.positions[g] for g in call.scheme.ulysses_group(comm.Get_rank())])


def _check(q, k, v, comm, trace, call, **options):
    """This rank's call, checked (`reference.call.check_call`: this rank's
    shard, the real `seq_len` inside the options), or the `call` resolved
    beforehand, if the arrays fit it; and the `trace` option."""
    if trace not in TRACE_CHOICES or isinstance(trace, int) and not isinstance(trace, bool):
        raise ValueError(f"trace must be one of {TRACE_CHOICES}, got {trace!r}")
    if call is None:
        return check_call(q, k, v, n_devices=comm.Get_size(), per_device=True, **options)
    if len(call.positions) != comm.Get_size():
        raise ValueError(f"call was resolved for {len(call.positions)} ranks, not the communicator's "
                         f"{comm.Get_size()}")
    return call.fits(q, k, v, options.get("grads"))


def agree(comm, check, **also):
    """Collective check: run ``check()`` on this rank (an object whose
    ``describe()`` is a dict of what must agree, such as a
    `reference.call.RingCall`, or an exception), allgather its description
    (with `also`, more values that must agree), and raise the same clear
    error on every rank if any rank failed or two ranks disagree. Returns
    what ``check()`` returned."""
    if not all(hasattr(comm, name) for name in ("allgather", "Get_rank", "Get_size", "Dup")):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    try:
        checked, error = check(), None
        mine = {**checked.describe(), **also}
    except Exception as e:      # noqa: BLE001 - reported to every rank, re-raised below
        checked, mine, error = None, None, e
    wait_quietly(comm)          # a rank that comes early sleeps instead of spinning in the allgather
    everyone = comm.allgather((mine, _describe_error(error)))    # every rank gets here
    failed = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
    if failed:
        if error is not None:
            raise error
        r, (kind, message) = failed[0]
        raise _ERRORS.get(kind, RuntimeError)(
            f"rank {r}{communicator_name(comm)} failed its input check: {kind}: {message}")
    for key, value in mine.items():
        values = [d[key] for d, _ in everyone]
        if any(x != value for x in values):
            raise ValueError(f"ranks{communicator_name(comm)} disagree on {key}: "
                             + ", ".join(f"rank {r} {x!r}" for r, x in enumerate(values)))
    return checked


_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


def _describe_error(e):
    return None if e is None else (type(e).__name__, str(e))


def _trace_result(log, comm, trace):
    if trace == "rank":
        return (log,)
    if trace:
        return (gather_trace(log, comm),)
    return ()


def gather_trace(log, comm):
    """Every rank's RoundLog -> one Trace ([t, j] arrays), on every rank. Collective."""
    wait_quietly(comm)          # ranks that finished their rounds first sleep until the last one has
    return Trace.from_logs(comm.allgather(log))
