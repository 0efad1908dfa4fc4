"""Faults that must end an MPI job quickly, with a clear message and a non-zero exit,
and faults a job must survive with the right answer.

    mpiexec -n 3 python tests/support/mpi/fault_worker.py shapes            # ranks disagree on q's shape
    mpiexec -n 3 python tests/support/mpi/fault_worker.py bad-input         # one rank's input is invalid
    mpiexec -n 3 python tests/support/mpi/fault_worker.py disagree          # every agreed field, one at a time
    mpiexec -n 3 python -m mpi4py tests/support/mpi/fault_worker.py MODE    # MODE below

The first three run without ``-m mpi4py`` on purpose: the agreement check alone
must make every rank raise. A failure in the middle of the ring leaves a
neighbour waiting for a block that never comes, and only MPI_Abort ends it, so
these modes run with ``-m mpi4py``:

  raise            rank 1's step raises in round 0 of the forward
  raise-last       rank 1's step raises in the last round of the forward
  raise-backward   rank 1's backward step raises in round 1
  before / after   rank 1 raises before calling the ring / after it returned
  exit             rank 1 exits (os._exit) in round 1 of the forward, saying nothing
  leave            rank 1 calls sys.exit(0) in round 1, blocks above the eager threshold
  again            2 ranks, two calls: rank 1 fails after its last transfer of the
                   first, rank 0 leaves before the second's first shift; rank 1
                   must name it, not take the first call's late "done" for it
  truncate         rank N-1 sends a larger block than expected in round 2 (a real MPI error)
  subcomm          4 ranks, the ring on world ranks 1..3: a disagreement, then a raise
  raise-all-to-all scheme "ulysses": rank 1 raises in its first all-to-all
  raise-all-gather scheme "all_gather": rank 1 raises in its gather's second shift
  slow             rank 1 sleeps 0.5 s in round 0 of each pass: the job must finish
                   with the right answer ("rank 0: correct")
"""

import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpi_impl import RingComm, ring_attention, ring_attention_backward
from mpi_impl.comm import RingError
from reference import attention, attention_backward, shard, unshard
from reference.step import Step

FAILING_RANK = 1


def inputs(c, hq=2, hkv=2, dtype=np.float64, n=1, d=4):
    """q, k, v of one rank: (1, c, hq, d), (1, c, hkv, d); the same on every rank."""
    rng = np.random.default_rng(0)
    return tuple(rng.standard_normal((1, c * n, h, d)).astype(dtype) for h in (hq, hkv, hkv))


def inject(name, round_to_fail, fault):
    """Make this rank's step (every version: `Step.forward` or `Step.backward`,
    named by `name`) call `fault()` in the given round (counted per call)."""
    real, calls = getattr(Step, name), []

    def faulty(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > round_to_fail:
            fault()
        return real(self, *args, **kwargs)
    setattr(Step, name, faulty)


def fail(message):
    def fault():
        raise RuntimeError(message)
    return fault


def exit_silently():
    print(f"rank {FAILING_RANK}: exiting in round 1", flush=True)
    os._exit(3)


def leave_quietly():
    print(f"rank {FAILING_RANK}: leaving in round 1", flush=True)
    sys.exit(0)


def sleep_once():
    done = []

    def fault():
        if not done:
            done.append(1)
            time.sleep(0.5)
    return fault


def in_ring_fault(mode, comm):
    """Faults injected into rank 1's ring: the other ranks run the ring as usual."""
    n, rank = comm.Get_size(), comm.Get_rank()
    q, k, v = inputs(256, d=64) if mode == "leave" else inputs(4)
    if rank == FAILING_RANK:
        if mode == "raise":
            inject("forward", 0, fail(f"injected failure on rank {FAILING_RANK} in round 0"))
        elif mode == "raise-last":
            inject("forward", n - 1, fail(f"injected failure in round {n - 1}"))
        elif mode == "raise-backward":
            inject("backward", 1, fail("injected failure in round 1 of the backward"))
        elif mode == "exit":
            inject("forward", 1, exit_silently)
        elif mode == "leave":
            inject("forward", 1, leave_quietly)
        elif mode == "before":
            raise RuntimeError(f"injected failure on rank {FAILING_RANK} before the ring")
    tile = 64 if mode == "leave" else 2
    out, lse = ring_attention(q, k, v, comm=comm, layout="contiguous", tile_size=tile)
    ring_attention_backward(q, k, v, out, lse, q, comm=comm, layout="contiguous", tile_size=tile)
    print(f"rank {rank}: ring done", flush=True)
    if mode == "after":
        comm.Barrier()          # every rank has said so before rank 1 ends the job
        if rank == FAILING_RANK:
            raise RuntimeError(f"injected failure on rank {FAILING_RANK} after the ring")


def in_collective_fault(mode, comm):
    """Rank 1 fails inside a scheme's collective: the all-to-all or the all-gather's shifts."""
    from mpi_impl.groups import AllToAll
    scheme, where, name, call_to_fail, collective = {
        "raise-all-to-all": ("ulysses", AllToAll, "all_to_all", 1, "all-to-all"),
        "raise-all-gather": ("all_gather", RingComm, "start_shift", 2, "all-gather"),
    }[mode]
    real, calls = getattr(where, name), []

    def faulty(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call_to_fail:
            raise RuntimeError(f"injected failure on rank {FAILING_RANK} in the {collective}")
        return real(self, *args, **kwargs)
    if comm.Get_rank() == FAILING_RANK:
        setattr(where, name, faulty)
    q, k, v = inputs(4)
    ring_attention(q, k, v, comm=comm, layout="striped", tile_size=2, scheme=scheme)
    print(f"rank {comm.Get_rank()}: ring done", flush=True)


def again(comm):
    """Mode "again" (module docstring), on RingComm directly."""
    rank = comm.Get_rank()

    def one_shift(ring):
        ring.finish_shift(ring.start_shift((np.full(4, float(rank)),), 1))
    try:
        with RingComm.on(comm) as ring:
            one_shift(ring)
            if rank == FAILING_RANK:
                raise ValueError(f"rank {rank} fails after its last transfer")
            time.sleep(0.5)             # rank 1 withdraws its notice receives before rank 0 says "done"
    except (ValueError, RingError) as e:
        print(f"rank {rank}: first call: {type(e).__name__}", flush=True)
    comm.Barrier()
    with RingComm.on(comm) as ring:
        if rank == 0:
            print("rank 0: leaving the second call", flush=True)
            sys.exit(0)
        one_shift(ring)


def truncate(comm):
    """Three rounds of RingComm shifts; in round 2 the last rank sends twice as
    many bytes as rank 0's receive buffer holds."""
    ring = RingComm.on(comm)
    for t in range(3):
        size = 4 if t == 2 and ring.rank == ring.size - 1 else 2
        ring.finish_shift(ring.start_shift((np.zeros(size),), tag=1))


def disagreements(q, k, v, out, lse):
    """Field that must agree -> how rank 1 calls the ring differently from the others."""
    base = dict(layout="striped", causal=True, scale=None, tile_size=2)

    def forward(q=q, k=k, v=v, **changes):
        return lambda comm: ring_attention(q, k, v, comm=comm, **dict(base, **changes))

    def backward(lse=lse, **changes):
        return lambda comm: ring_attention_backward(q, k, v, out, lse, q, comm=comm, **dict(base, **changes))

    q5, k5, v5 = inputs(5)
    return {                                 # field: (what ranks other than 1 call, what rank 1 calls)
        "kind": (forward(), backward()),
        "q": (forward(), forward(q5, k5, v5)),
        "k": (forward(), forward(*inputs(4, hq=2, hkv=1))),
        "dtype": (forward(), forward(*inputs(4, dtype=np.float32))),
        "layout": (forward(), forward(layout="contiguous")),
        "causal": (forward(), forward(causal=False)),
        "scale": (forward(), forward(scale=0.3)),
        "tile_size": (forward(), forward(tile_size=3)),
        "trace": (forward(), forward(trace=True)),
        "lse": (backward(), backward(lse=lse.astype(np.float32))),
    }


def disagree(comm):
    """Each agreed field in turn: every rank must raise "ranks disagree on <field>"."""
    rank = comm.Get_rank()
    q, k, v = inputs(4)
    out, lse = ring_attention(q, k, v, comm=comm, layout="striped", tile_size=2)
    for field, (usual, odd) in disagreements(q, k, v, out, lse).items():
        try:
            (odd if rank == FAILING_RANK else usual)(comm)
        except ValueError as e:
            print(f"rank {rank}: {field}: {e}", flush=True)
        else:
            print(f"rank {rank}: {field}: no error", flush=True)


def subcomm(world):
    """World rank 0 sits out; the ring runs on world ranks 1..3, numbered 0..2 there."""
    comm = world.Split(color=0 if world.Get_rank() == 0 else 1, key=world.Get_rank())
    if world.Get_rank() == 0:
        world.Barrier()
        return
    rank = comm.Get_rank()
    q, k, v = inputs(4)
    try:
        ring_attention(q, k, v, comm=comm, layout="striped", tile_size=2, causal=rank != FAILING_RANK)
    except ValueError as e:
        print(f"world rank {world.Get_rank()}: {e}", flush=True)
    if rank == FAILING_RANK:
        inject("forward", 0, fail("injected failure in round 0"))
    ring_attention(q, k, v, comm=comm, layout="striped", tile_size=2)
    world.Barrier()


def slow(comm):
    """Rank 1 is late in round 0 of both passes; the answer must not change."""
    n, rank = comm.Get_size(), comm.Get_rank()
    q, k, v = inputs(4, n=n)                            # the whole sequence, the same on every rank
    dout = np.cos(q)
    out, lse = attention(q, k, v)
    want = (out, lse) + attention_backward(q, k, v, out, lse, dout)
    qs, ks, vs, douts = (shard(x, n, "striped")[rank] for x in (q, k, v, dout))
    if rank == FAILING_RANK:
        inject("forward", 0, sleep_once())
        inject("backward", 0, sleep_once())
    o, l = ring_attention(qs, ks, vs, comm=comm, layout="striped", tile_size=2)
    grads = ring_attention_backward(qs, ks, vs, o, l, douts, comm=comm, layout="striped", tile_size=2)
    gathered = comm.gather((o, l) + tuple(grads))
    if rank == 0:
        for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
            got = unshard([g[i] for g in gathered], "striped", axis=2 if name == "lse" else 1)
            np.testing.assert_allclose(got, want[i], rtol=1e-10, atol=1e-10, err_msg=name)
        print("rank 0: correct", flush=True)


def main(mode):
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if mode in ("shapes", "bad-input"):
        q, k, v = inputs(5 if mode == "shapes" and rank == FAILING_RANK else 4,
                         hq=3 if mode == "bad-input" and rank == FAILING_RANK else 2)
        ring_attention(q, k, v, comm=comm, layout="contiguous", tile_size=2)
    elif mode == "disagree":
        disagree(comm)
    elif mode == "truncate":
        truncate(comm)
    elif mode == "again":
        again(comm)
    elif mode == "subcomm":
        subcomm(comm)
    elif mode == "slow":
        slow(comm)
    elif mode in ("raise-all-to-all", "raise-all-gather"):
        in_collective_fault(mode, comm)
    else:
        in_ring_fault(mode, comm)
    print(f"rank {rank}: finished without error", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
