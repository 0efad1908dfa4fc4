"""Buffer hazards of the ring, made to fail on any machine and at real sizes.

At the sizes of the other tests (a few KiB a message) MPI copies each message
when it is sent (the eager protocol), so a buffer written while its send is in
flight goes unnoticed. Here:
- the ring (reference.ring) runs on threads over `StrictRing`, which reads send
  buffers as late as the contract allows and scribbles on receive buffers until
  the data lands (tests/strict_comm.py): forward and backward equal the dense
  reference for random cases;
- mpi_impl.RingComm runs the ring over `CheckingMPI`, a stand-in MPI that
  refuses a send buffer written before its request is waited for, a receive
  into a send not waited for, and a send never waited for;
- both checkers catch the hazards they are for (small loops that commit them);
- the ring runs on real MPI ranks with every message of K, V, dK and dV at
  least 256 KiB, above the eager threshold of MPICH and Open MPI, so that MPI
  reads the buffers during the transfer (the rendezvous protocol).

    .venv/bin/python -m pytest tests/test_hazards.py -q
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import Case, assert_close, cases
from mpi_impl.comm import RingComm
from reference import attention, attention_backward, positions, ring, shard, unshard
from strict_comm import CheckingMPI, HazardError, StrictRing, run_threads

# -- the ring on a communication object, on threads ----------------------------------


def run_ring(case, make_comm, check_done):
    """Forward, then backward (from the dense out and lse, as tests/test_ring.py
    does), on case.n_devices threads, each with make_comm(rank, world); returns
    (out, lse, dq, dk, dv) in natural order, and the dense (out, lse, dq, dk, dv)."""
    q, k, v, dout = case.inputs()
    opts = dict(causal=case.causal, scale=case.scale)
    out, lse = attention(q, k, v, **opts)
    want = (out, lse) + attention_backward(q, k, v, out, lse, dout, **opts)
    n, layout = case.n_devices, case.layout
    pos = positions(case.S, n, layout)
    qs, ks, vs, outs, douts = (shard(x, n, layout) for x in (q, k, v, out, dout))
    lses = shard(lse, n, layout, axis=2)
    scale = case.scale if case.scale is not None else case.D ** -0.5
    ring_opts = dict(causal=case.causal, scale=scale, tile_size=case.tile_size)

    def device(j, world):
        comm = make_comm(j, world)
        o, l, _ = ring.ring_forward(qs[j], ks[j], vs[j], pos[j], pos[j], comm, **ring_opts)
        dq, dk, dv, _ = ring.ring_backward(qs[j], ks[j], vs[j], outs[j], lses[j], douts[j], pos[j], pos[j],
                                           comm, **ring_opts)
        check_done(j, comm)
        return o, l, dq, dk, dv

    results = run_threads(n, device)
    got = tuple(unshard([r[i] for r in results], layout, axis=2 if i == 1 else 1) for i in range(5))
    return got, want


def assert_matches(case, got, want):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        factor = case.tolerance_factor if name in ("out", "lse") else case.grad_tolerance_factor
        assert_close(g, w, case.dtype, what=f"{name} of {case}", factor=factor)


def strict(rank, world):
    return StrictRing(rank, world)


def strict_done(rank, comm):
    assert not comm.unfinished(), f"device {rank} left shifts unfinished: {comm.unfinished()}"


def mpi_ring(rank, world):
    return RingComm(CheckingMPI(rank, world))


def mpi_ring_done(rank, comm):
    assert not comm.comm.unwaited(), f"rank {rank}: sends never waited for: {comm.comm.unwaited()}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_devices=5))
def test_ring_on_strict_comm_matches_dense(case):
    assert_matches(case, *run_ring(case, strict, strict_done))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_devices=5))
def test_ring_comm_on_checking_mpi_matches_dense(case):
    assert_matches(case, *run_ring(case, mpi_ring, mpi_ring_done))


# -- the checkers catch what they are for -----------------------------------------------

def _pass_on(n, rounds, body, make_comm=strict):
    """body(comm, block, t) -> the next block, on n threads from block = [rank]."""
    def device(j, world):
        comm = make_comm(j, world)
        block = (np.full(4, float(j)),)
        for t in range(rounds):
            block = body(comm, block, t)
        return comm
    return run_threads(n, device)


def test_strict_ring_refuses_a_send_buffer_written_before_finish():
    def body(comm, block, t):
        shift = comm.start_shift(block, tag=2)
        block[0][...] = 0.0                 # zeroing while the send may still read it
        return comm.finish_shift(shift)
    with pytest.raises(HazardError, match=r"array 0 of the dK/dV block sent in round 0 was written before"):
        _pass_on(3, 2, body)


def test_strict_ring_scribbles_on_a_block_held_too_long():
    """A block kept past the second start_shift after it arrived reads garbage."""
    kept, seen = {}, {}

    def body(comm, block, t):
        if t == 1:
            kept[comm.rank] = block[0]      # the block that arrived in round 0
        shift = comm.start_shift((block[0].copy(),), tag=1)
        if t == 2:                          # the second start_shift after it arrived
            seen[comm.rank] = kept[comm.rank].copy()
        return comm.finish_shift(shift)
    _pass_on(3, 3, body)
    assert sorted(seen) == [0, 1, 2] and all(np.isnan(a).all() for a in seen.values()), seen


def test_strict_ring_reports_unfinished_shifts():
    def body(comm, block, t):
        comm.start_shift(block, tag=1)
        return block
    comms = _pass_on(2, 1, body)
    assert [c.unfinished() for c in comms] == [[("K/V block", 0)]] * 2


def test_checking_mpi_refuses_a_send_buffer_written_before_its_wait():
    def body(comm, block, t):
        shift = comm.start_shift(block, tag=2)
        block[0][...] = 0.0
        return comm.finish_shift(shift)
    with pytest.raises(HazardError, match="send buffer .* was written before its send was waited for"):
        _pass_on(3, 2, body, make_comm=mpi_ring)


def test_checking_mpi_refuses_a_receive_into_a_send_not_waited_for():
    """A RingComm that waits for its receives only (the sends still reading)
    hands the sent buffers out again to receive into."""
    def receives_only(comm, block, t):
        shift = comm.start_shift(block, tag=1)
        for request in shift.requests[0::2]:            # the receives
            request.Wait()
        comm._in_flight.remove(shift)
        comm._pools[1].held = next(i for i, s in enumerate(comm._pools[1].sets) if s is shift.received)
        return shift.received
    with pytest.raises(HazardError, match="receiving .* into the buffer of a send .* not yet waited for"):
        _pass_on(3, 4, receives_only, make_comm=mpi_ring)


# -- real MPI ranks, messages above the eager threshold ------------------------------------

MIN_MESSAGE_BYTES = 256 * 1024
LARGE = {   # n ranks -> cases whose every K, V, dK, dV message is >= 256 KiB
    3: [Case(layout=layout, n_devices=3, B=1, S=1536, Hq=2, Hkv=1, D=64, tile_size=128, causal=causal,
             scale=None, dtype=np.float64, kind="gaussian", seed=s)
        for s, (layout, causal) in enumerate([("striped", True), ("zigzag", False)])],
    2: [Case(layout="striped", n_devices=2, B=1, S=2048, Hq=2, Hkv=2, D=32, tile_size=256, causal=True,
             scale=None, dtype=np.float32, kind="gaussian", seed=7)],
}


@pytest.mark.parametrize("n", sorted(LARGE))
def test_mpi_ring_with_messages_above_the_eager_threshold(n, tmp_path):
    pytest.importorskip("mpi4py")
    from test_mpi import MPIEXEC, assert_case, run_batch
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    for case in LARGE[n]:
        # K and V travel in their dtype, dK and dV in the accumulation dtype (the same here)
        kv_block = case.B * case.c * case.Hkv * case.D * np.dtype(case.dtype).itemsize
        assert kv_block >= MIN_MESSAGE_BYTES, (case, kv_block)
    results = run_batch(n, LARGE[n], tmp_path)
    for i, case in enumerate(LARGE[n]):
        assert_case(case, results[i])
