"""Buffer hazards of the ring, made to fail on any machine and at real sizes,
and RingComm's contract, guard by guard.

At the sizes of the other tests (a few KiB a message) MPI copies each message
when it is sent (the eager protocol), so a buffer written while its send is in
flight goes unnoticed. Here:
- the ring (reference.ring) runs on threads over `StrictRing`, which reads send
  buffers as late as the contract allows and scribbles on receive buffers until
  the data lands (tests/support/strict_comm.py): forward and backward equal the dense
  reference for random cases;
- mpi_impl.RingComm runs the ring over `CheckingMPI`, a stand-in MPI between
  threads that reads a send buffer when the receive completes and refuses a
  send buffer written before its send completes, a receive into a send not
  complete, and a send never completed;
- RingComm's contract, one guard at a time, on `ScriptedMPI` (one thread, the
  test playing the neighbour), so that no guard covers for another as they do
  in the ring: a shift finished twice or never started, a tag started twice,
  a block sent after its buffers were handed back, the held block never
  received into, a send in flight completed before its buffers receive again,
  `finish_shift` waiting for its receives only, `close` completing the sends,
  `progress` moving transfers, and a neighbour that left the ring named;
- both checkers catch the hazards they are for (small loops that commit them);
- the ring runs on real MPI ranks with every message of K, V, dK and dV at
  least 256 KiB, above the eager threshold of MPICH and Open MPI, so that MPI
  reads the buffers during the transfer (the rendezvous protocol);
- a 4 MiB block arrives while its receiver computes and calls progress()
  (real MPI, no timing), and the trace's timeline orders each block's arrival.

    .venv/bin/python -m pytest tests/mpi/test_hazards.py -q
"""

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from conftest import Case, assert_close, cases
from mpi_impl.comm import TAG_STRIDE, RingComm, RingError, ShiftOrderError
from mpi_impl.memory import HostMemory
from mpi_impl.notices import FROM_NEXT, FROM_PREV
from reference import attention, attention_backward, positions, ring, shard, steps, unshard
from reference.masks import as_mask
from strict_comm import CheckingMPI, HazardError, ScriptedMPI, StrictRing, run_threads

# -- the ring on a communication object, on threads ----------------------------------


def run_ring(case, make_comm, check_done):
    """Forward, then backward (from the dense out and lse, as tests/steps/test_ring.py
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
    ring_opts = dict(mask=as_mask(case.causal), scale=scale, tile_size=case.tile_size, step=steps.get("auto", xp=np))

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
    comm.close()            # the sent arrays are read once more


def mpi_ring(rank, world):
    return RingComm(CheckingMPI(rank, world))


def mpi_ring_done(rank, comm):
    comm.close()
    assert not comm.comm.incomplete(), f"rank {rank}: sends never completed: {comm.comm.incomplete()}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_devices=5))
def test_ring_on_strict_comm_matches_dense(case):
    assert_matches(case, *run_ring(case, strict, strict_done))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(max_devices=5))
def test_ring_comm_on_checking_mpi_matches_dense(case):
    assert_matches(case, *run_ring(case, mpi_ring, mpi_ring_done))


def test_the_ring_hands_the_step_its_comms_progress():
    """Forward and backward, the loop passes `comm.progress` to the step, which
    calls it between tiles: version 1 once after every tile it computes."""
    case = Case(layout="striped", n_devices=3, B=1, S=24, Hq=2, Hkv=1, D=4, tile_size=4, causal=True,
                scale=None, dtype=np.float64, kind="gaussian", seed=3)
    q, k, v, dout = case.inputs()
    pos = positions(case.S, 3, case.layout)
    qs, ks, vs, douts = (shard(x, 3, case.layout) for x in (q, k, v, dout))
    opts = dict(mask=as_mask(True), scale=0.5, tile_size=4, step=steps.get("v1"))

    def device(j, world):
        comm = strict(j, world)
        o, lse, forward = ring.ring_forward(qs[j], ks[j], vs[j], pos[j], pos[j], comm, **opts)
        after_forward = comm.progress_calls
        backward = ring.ring_backward(qs[j], ks[j], vs[j], o, lse, douts[j], pos[j], pos[j], comm, **opts)[3]
        strict_done(j, comm)
        return after_forward, comm.progress_calls, forward.tiles_computed.sum(), backward.tiles_computed.sum()

    for rank, (after_forward, total, forward_tiles, backward_tiles) in enumerate(run_threads(3, device)):
        assert forward_tiles > 0 and backward_tiles > 0
        assert after_forward == forward_tiles, f"rank {rank}: forward"
        assert total - after_forward == backward_tiles, f"rank {rank}: backward"


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


def test_strict_ring_refuses_a_sent_buffer_written_before_the_ring_ends():
    """Written after finish_shift returned: a send may read it until close."""
    def body(comm, block, t):
        arrived = comm.finish_shift(comm.start_shift(block, tag=1))
        block[0][...] = 0.0
        return arrived

    def device(j, world):
        comm = StrictRing(j, world)
        block = (np.full(4, float(j)),)
        for t in range(2):
            block = body(comm, block, t)
        comm.close()
    with pytest.raises(HazardError, match=r"array 0 of the K/V block sent in round [01] was written before the ring ended"):
        run_threads(3, device)


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


def test_checking_mpi_refuses_a_send_buffer_written_before_it_completes():
    def body(comm, block, t):
        shift = comm.start_shift(block, tag=2)
        block[0][...] = 0.0
        return comm.finish_shift(shift)
    with pytest.raises(HazardError, match="send buffer .* was written before its send completed"):
        _pass_on(3, 2, body, make_comm=mpi_ring)


def test_checking_mpi_refuses_a_receive_into_a_send_not_complete():
    def device(j, world):
        mpi = CheckingMPI(j, world)
        buf = np.zeros(8, np.uint8)
        mpi.Isend(buf, dest=(j + 1) % 2, tag=16)
        mpi.Irecv(buf, source=(j - 1) % 2, tag=16)
    with pytest.raises(HazardError, match="receiving .* into the buffer of a send .* not yet complete"):
        run_threads(2, device)


# -- RingComm's contract, guard by guard (ScriptedMPI: the test is the neighbour) --------

def block(value, n=4):
    """A K/V-like block of two arrays."""
    return np.full(n, float(value)), np.array([value], dtype=np.int64)


def scripted(**kwargs):
    mpi = ScriptedMPI(**kwargs)
    return RingComm(mpi), mpi


def one_shift(ring_comm, mpi, arrays, arriving, tag=1):
    """start_shift(arrays), the neighbour's `arriving` lands, finish_shift."""
    shift = ring_comm.start_shift(arrays, tag)
    mpi.deliver(tag, arriving)
    return ring_comm.finish_shift(shift)


def test_guard_finish_twice():
    ring_comm, mpi = scripted()
    shift = ring_comm.start_shift(block(0), 1)
    mpi.deliver(1, block(9))
    ring_comm.finish_shift(shift)
    with pytest.raises(ShiftOrderError, match=r"finish_shift called twice: the K/V block of round 0"):
        ring_comm.finish_shift(shift)


def test_guard_finish_never_started():
    ring_comm, _ = scripted()
    other, other_mpi = scripted()
    for handle in (1, None, other.start_shift(block(0), 1)):
        with pytest.raises(ShiftOrderError, match="finish_shift called before start_shift"):
            ring_comm.finish_shift(handle)


def test_guard_start_twice_with_one_tag():
    ring_comm, mpi = scripted()
    ring_comm.start_shift(block(0), 1)
    ring_comm.start_shift(block(0), 2)                  # another tag: fine
    with pytest.raises(ShiftOrderError, match=r"start_shift called twice: the K/V block of round 0 is still"):
        ring_comm.start_shift(block(1), 1)


def test_guard_block_sent_after_its_buffers_came_round_again():
    ring_comm, mpi = scripted()
    first = one_shift(ring_comm, mpi, block(0), block(1))        # arrives in set 0
    one_shift(ring_comm, mpi, first, block(2))                   # set 1; `first` is sent on
    mpi.take()
    with pytest.raises(ShiftOrderError, match="array 0 to send lies in the buffers the next K/V block arrives in"):
        ring_comm.start_shift(first, 1)                          # set 0 again: `first` is no longer valid


def test_held_block_is_not_received_into():
    """The block finish_shift returned stays intact through the next shift,
    here sent as a copy so that the guard above cannot fire in its place."""
    ring_comm, mpi = scripted()
    held = one_shift(ring_comm, mpi, block(0), block(1))
    shift = ring_comm.start_shift(tuple(a.copy() for a in held), 1)
    assert all(np.array_equal(a, b) for a, b in zip(held, block(1))), held      # scribbled on?
    mpi.deliver(1, block(2))
    assert all(np.array_equal(a, b) for a, b in zip(ring_comm.finish_shift(shift), block(2)))
    assert all(np.array_equal(a, b) for a, b in zip(held, block(1))), held


def test_send_in_flight_completes_before_its_buffers_receive_again():
    """The ring's pattern: the block that arrived is sent on. When its set
    comes round again, the send still reading it is completed first."""
    ring_comm, mpi = scripted(waits_complete_sends=True)
    held = one_shift(ring_comm, mpi, block(0), block(1))        # set 0
    held = one_shift(ring_comm, mpi, held, block(2))            # set 1; set 0 is being sent
    assert 16 in mpi.sends_pending()
    ring_comm.start_shift(held, 1)                              # set 0 again: its send first
    completed, reposted = mpi.log.index("complete send 16"), len(mpi.log) - 1 - mpi.log[::-1].index("post receive 16")
    assert completed < reposted, mpi.log


def test_a_tag_whose_arrays_change_shape_receives_into_new_buffers():
    """The buffer sets are made for the arrays a tag carries: when they change
    (another call's block size on a RingComm kept), the next shift receives
    into sets of the new shape, never into the old ones."""
    ring_comm, mpi = scripted()
    one_shift(ring_comm, mpi, block(0), block(1))
    for value in (2, 3, 4):                         # through both buffer sets and round again
        arrived = one_shift(ring_comm, mpi, block(0, n=6), block(value, n=6))
        mpi.take()
        assert [a.shape for a in arrived] == [(6,), (1,)]
        assert all(np.array_equal(a, b) for a, b in zip(arrived, block(value, n=6)))


def test_finish_waits_for_its_receives_only():
    """The neighbour has not taken the block sent (it computes): finish_shift
    returns what arrived all the same."""
    ring_comm, mpi = scripted(waits_complete_sends=False)       # waiting for a send raises
    arrived = one_shift(ring_comm, mpi, block(0), block(1))
    assert all(np.array_equal(a, b) for a, b in zip(arrived, block(1)))
    assert mpi.sends_pending() == [16, 17]
    mpi.take()
    ring_comm.close()


def test_close_completes_the_sends_and_refuses_unfinished_shifts():
    ring_comm, mpi = scripted(waits_complete_sends=True)
    one_shift(ring_comm, mpi, block(0), block(1))
    assert mpi.sends_pending() == [16, 17]
    ring_comm.close()
    assert mpi.sends_pending() == [], mpi.log
    assert not mpi.pending, "the notice receives were not withdrawn"
    ring_comm, mpi = scripted()
    ring_comm.start_shift(block(0), 1)
    with pytest.raises(ShiftOrderError, match="closed with shifts never finished: the K/V block of round 0"):
        ring_comm.close()


def test_progress_moves_transfers_during_the_step():
    """Between tiles the step calls progress(): a block that landed is seen
    (its arrival time is taken then), and a send the neighbour took completes."""
    ring_comm, mpi = scripted(waits_complete_sends=False)
    shift = ring_comm.start_shift(block(0), 1)
    mpi.deliver(1, block(1))
    mpi.take()
    ring_comm.progress()
    assert shift.arrived_at is not None and not shift.receives and not shift.sends
    ring_comm.finish_shift(shift)
    assert ring_comm.transfers[0].arrived <= ring_comm.transfers[0].handed


class LateMemory(HostMemory):
    """Host memory whose transfers may begin only once `ready` has been asked
    `opens_at[i]` times in all, for the i-th buffer set made (a GPU still
    copying what MPI will read)."""

    def __init__(self, *opens_at):
        self.asked, self.opens_at, self.sets = 0, opens_at, []

    def buffer_set(self, like):
        self.sets.append(super().buffer_set(like))
        return self.sets[-1]

    def ready(self, buffers):
        self.asked += 1
        return self.asked >= self.opens_at[self.sets.index(buffers)]


def posted(mpi):
    return [entry for entry in mpi.log if entry.startswith("post") and int(entry.split()[-1]) >= TAG_STRIDE]


def test_a_shift_is_posted_once_its_memory_is_ready():
    """start_shift posts nothing while the memory object is not ready, and
    returns; progress asks again (without waiting) and posts it once ready."""
    memory, mpi = LateMemory(3), ScriptedMPI(waits_complete_sends=False)
    ring_comm = RingComm(mpi, memory)
    shift = ring_comm.start_shift(block(0), 1)                  # asked once
    assert not shift.posted and posted(mpi) == [] and not ring_comm.all_arrived()
    ring_comm.progress()                                        # twice
    assert not shift.posted and posted(mpi) == []
    ring_comm._tested_at = float("-inf")
    ring_comm.progress()                                        # ready: posted
    assert shift.posted and posted(mpi) == ["post receive 16", "post send 16", "post receive 17", "post send 17"]
    mpi.deliver(1, block(1))
    assert all(np.array_equal(a, b) for a, b in zip(ring_comm.finish_shift(shift), block(1)))
    mpi.take()
    ring_comm.close()


def test_finish_posts_every_shift_as_it_becomes_ready():
    """finish_shift waits for one shift's receives, but a neighbour may be
    waiting for another shift's send: while it waits, it posts every shift
    as its memory becomes ready, and only then waits without asking."""
    memory, mpi = LateMemory(3, 9), ScriptedMPI(waits_complete_sends=False)   # K, V ready first
    ring_comm = RingComm(mpi, memory)
    kv, grads = ring_comm.start_shift(block(0), ring.KV), ring_comm.start_shift(block(7), ring.DKV)
    assert posted(mpi) == []
    mpi.deliver_later(ring.KV, block(1))                        # lands when its receive is waited for
    arrived = ring_comm.finish_shift(kv)
    assert kv.posted and grads.posted and memory.asked >= 9
    assert all(np.array_equal(a, b) for a, b in zip(arrived, block(1)))
    mpi.deliver(ring.DKV, block(8))
    ring_comm.finish_shift(grads)
    mpi.take()
    ring_comm.close()


def test_all_arrived_says_whether_finish_would_wait():
    ring_comm, mpi = scripted(waits_complete_sends=False)
    assert ring_comm.all_arrived()                              # nothing in flight
    shift = ring_comm.start_shift(block(0), 1)
    ring_comm.progress()
    assert not ring_comm.all_arrived()
    mpi.deliver(1, block(1))
    ring_comm._tested_at = float("-inf")                        # the next progress() tests again
    ring_comm.progress()
    assert ring_comm.all_arrived()
    ring_comm.finish_shift(shift)


def test_progress_tests_the_requests_at_most_once_an_interval(monkeypatch):
    """A step calls progress() between tiles however small: within one
    `progress_interval_s` it tests the requests once (a clock that stands still here)."""
    import mpi_impl.comm as comm_module
    ring_comm, mpi = scripted(waits_complete_sends=False)
    ring_comm.start_shift(block(0), 1)
    tests = []
    for request in mpi.pending:
        request.Test = lambda request=request: tests.append(request.tag) or request.done
    now = [100.0]
    monkeypatch.setattr(comm_module.time, "perf_counter", lambda: now[0])
    ring_comm.progress()
    first = len(tests)
    assert first == 4                                           # 2 receives, 2 sends of tag 1
    ring_comm.progress()
    ring_comm.progress()
    assert len(tests) == first
    now[0] += ring_comm.progress_interval_s
    ring_comm.progress()
    assert len(tests) == 2 * first


def test_neighbour_that_left_is_named():
    """A receive from a neighbour that sent word it left ends with its reason."""
    ring_comm, mpi = scripted()
    shift = ring_comm.start_shift(block(0), 1)
    mpi.notify(FROM_PREV, "SystemExit: 0")
    with pytest.raises(RingError, match=r"^rank 0: round 0: receiving the K/V block \(array 0 of 2\) from rank 1 "
                                        r"failed: rank 1 left the ring \(SystemExit: 0\)$"):
        ring_comm.finish_shift(shift)


def test_neighbour_that_left_after_its_last_transfer_fails_the_close():
    """Every transfer with rank 1 done, then its notice: the ring call is
    collective, so close() says rank 1 left rather than returning into a
    collective that would wait for it for ever."""
    ring_comm, mpi = scripted()
    one_shift(ring_comm, mpi, block(0), block(1))
    mpi.take()                                                  # rank 1 received what it was sent
    mpi.notify(FROM_PREV, "RuntimeError: out of memory")       # (a 2-rank ring: its prev and next)
    with pytest.raises(RingError, match=r"^rank 0: rank 1 left the ring \(RuntimeError: out of memory\) "
                                        r"before its end here$"):
        ring_comm.close()


def test_close_waits_for_the_notice_of_a_neighbour_still_in_its_ring():
    """Every transfer with rank 1 done, and its notice not here when close
    begins (it leaves while computing its last round): close waits for rank
    1's end of the ring and names it, instead of returning into the next
    collective, which would wait for rank 1 for ever (that race hung a job
    in 1 launch of 8 on MPICH)."""
    ring_comm, mpi = scripted(neighbour_ends="SystemExit: 0")
    one_shift(ring_comm, mpi, block(0), block(1))
    mpi.take()
    with pytest.raises(RingError, match=r"^rank 0: rank 1 left the ring \(SystemExit: 0\) before its end here$"):
        ring_comm.close()


def test_close_says_done_to_both_neighbours_and_waits_for_theirs():
    """The end of a ring call is one notice each way between neighbours:
    "done" (empty) sent to both, both of theirs received, nothing left
    pending; a neighbour that never comes makes close wait (here: raise)."""
    ring_comm, mpi = scripted()
    one_shift(ring_comm, mpi, block(0), block(1))
    ring_comm.close()
    sent = [line for line in mpi.log if line in ("post send 0", "post send 1")]
    assert sent == ["post send 0", "post send 1"], mpi.log
    assert {"complete receive 0", "complete receive 1", "complete send 0", "complete send 1"} <= set(mpi.log)
    # told before waiting: a neighbour waits for this rank's notice as this rank waits for its
    assert mpi.log.index("post send 1") < mpi.log.index("complete receive 0"), mpi.log
    assert not mpi.pending, mpi.log
    ring_comm, mpi = scripted(neighbour_ends=None)
    one_shift(ring_comm, mpi, block(0), block(1))
    with pytest.raises(HazardError, match="waiting for a receive \\(tag 0\\)"):
        ring_comm.close()
    # the close failed after "done": still one notice each way (a second would arrive in a later call)
    assert [line for line in mpi.log if line.startswith("post send") and line[-2:] in (" 0", " 1")] == \
        ["post send 0", "post send 1"], mpi.log


def test_ring_tag_0_is_the_notices():
    """Ring tag 0 carries the neighbours' notices: a shift cannot take it (nor a tag that is no int)."""
    ring_comm, mpi = scripted()
    for tag in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"tag must be an int >= 1 \(ring tag 0 carries the neighbours' notices\)"):
            ring_comm.start_shift(block(0), tag)
    assert not [line for line in mpi.log if line.startswith("post send")], mpi.log


def test_a_neighbour_done_before_its_block_lands_is_waited_for():
    """A neighbour's "done" may overtake its last block (messages of different
    tags keep no order between them): the receive is then waited for, and the
    block handed back is the one that landed."""
    ring_comm, mpi = scripted()
    shift = ring_comm.start_shift(block(0), 1)
    mpi.notify(FROM_PREV, "")
    mpi.deliver_later(1, block(1))
    arrived = ring_comm.finish_shift(shift)
    assert all(np.array_equal(a, b) for a, b in zip(arrived, block(1)))


class DupMPI(ScriptedMPI):
    """ScriptedMPI that counts the duplicates made of it and freed."""
    made = freed = 0

    def Dup(self):
        self.made += 1
        return self

    def Free(self):
        self.freed += 1


@pytest.mark.parametrize("ends", ["closed", "failed", "failed, neighbours done", "failed, neighbours left"])
def test_the_communicator_on_duplicated_is_freed_unless_a_message_may_still_come(ends):
    """One duplicate per ring call, freed at its end (MPICH runs out of
    communicators after about 2,047 that are not), by close or by leave; but
    a call that failed keeps its duplicate, never freed, unless both
    neighbours said "done": a late notice or block of theirs would otherwise
    be taken by the next call, whose duplicate reuses the context."""
    from mpi_impl import notices
    mpi = DupMPI()
    kept = len(notices.KEPT)
    with pytest.raises(ValueError) if ends != "closed" else contextlib.nullcontext():
        with RingComm.on(mpi) as ring_comm:
            one_shift(ring_comm, mpi, block(0), block(1))
            if ends != "closed" and ends != "failed":
                said = "" if ends == "failed, neighbours done" else "RuntimeError: x"
                mpi.notify(FROM_PREV, said)
                mpi.notify(FROM_NEXT, said)
            if ends != "closed":
                raise ValueError("the step failed")
    freed = int(ends in ("closed", "failed, neighbours done"))
    assert (mpi.made, mpi.freed) == (1, freed)
    assert notices.KEPT[kept:] == ([] if freed else [mpi])
    ring_comm.close()                                   # a second close frees nothing more
    assert mpi.freed == freed
    del notices.KEPT[kept:]


def test_a_rank_leaves_the_ring_once():
    """leave() after the ring ended (a second error, or after close) tells
    the neighbours nothing more: one notice each, from the first."""
    ring_comm, mpi = scripted()
    ring_comm.start_shift(block(0), 1)
    ring_comm.leave(ValueError("the step failed"))
    ring_comm.leave(RuntimeError("and again"))
    ring_comm.close()
    assert [r for r in mpi.log if r.startswith("post send") and int(r.split()[-1]) < 16] == \
        ["post send 0", "post send 1"], mpi.log


def test_a_block_that_is_not_contiguous_is_refused_before_anything_is_posted():
    """MPI must read the caller's array itself: a strided view would be sent
    from a copy that may be gone before the send completes."""
    ring_comm, mpi = scripted()
    with pytest.raises(ValueError, match=r"ring buffers must be C-contiguous, got an array of shape \(4,\)"):
        ring_comm.start_shift((np.arange(8.0)[::2], np.zeros(1, np.int64)), 1)
    assert not [r for r in mpi.log if r.startswith("post") and int(r.split()[-1]) >= 16], mpi.log


def test_leaving_tells_the_neighbours_and_settles_what_is_in_flight():
    """An error ends the ring on this rank: both neighbours are told why,
    the receive in flight is cancelled and the send completed."""
    ring_comm, mpi = scripted(waits_complete_sends=True)
    with pytest.raises(ValueError):
        with ring_comm:
            ring_comm.start_shift(block(0), 1)
            raise ValueError("the step failed")
    told = [r for r in mpi.log if r.startswith("post send") and int(r.split()[-1]) < 16]
    assert told == ["post send 0", "post send 1"], mpi.log
    # receives cancelled (the notices' too), sends completed; the notices travel on
    assert [(r.kind, r.tag) for r in mpi.pending] == [("send", 0), ("send", 1)], mpi.log


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


def test_block_arrives_while_its_receiver_computes_given_progress():
    """tests/support/mpi/progress_worker.py: `ring_forward` on 2 ranks, rank 0 idle in
    finish_shift, rank 1's step computing tiles and calling the progress the
    ring handed it between them; its 4 MiB block (rendezvous: MPI moves it only
    inside MPI calls) completes before rank 1's step ends. No timing: rank 1
    computes until the block is there."""
    pytest.importorskip("mpi4py")
    from test_mpi import MPIEXEC, WORKERS, mpirun
    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    proc, _ = mpirun(2, str(WORKERS / "progress_worker.py"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "rank 1: arrived during the step" in output and output.count(": done") == 2, output


# -- the trace's timeline ------------------------------------------------------------

def test_trace_timeline_orders_each_blocks_arrival_between_its_sending_and_its_use():
    """mpi_impl on 3 ranks as threads (RingComm over the stand-in MPI): each
    round's step starts after the last; the block received in round t arrived
    after that round's step began (its receive is first tested then) and
    before the next round's step, which uses it; none is recorded for the last
    round, which receives nothing."""
    import threading

    import mpi_impl
    from test_gpu import ThreadComm, fake_world
    n = 3
    world, gathered, barrier = fake_world(n), [None] * n, threading.Barrier(n)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 2, 4)) for _ in range(3))

    def device(j, _world):
        comm = ThreadComm(j, n, world, gathered, barrier)
        return mpi_impl.ring_attention(q, k, v, comm=comm, layout="striped", tile_size=2, trace=True)[2]

    for trace in run_threads(n, device)[:1]:
        for j in range(n):
            start, arrived = trace.start_s[:, j], trace.arrived_s[:, j]
            assert (np.diff(start) > 0).all(), start
            assert (arrived[:-1] >= start[:-1]).all() and (arrived[:-1] <= start[1:]).all(), (start, arrived)
            assert np.isnan(arrived[-1])
