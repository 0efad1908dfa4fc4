"""The end of a ring call on a ring of three (`mpi_impl.notices`), where a
rank's two neighbours are two ranks: a transfer waits for the notice of the
neighbour it moves data with, close hears from both, a failed call keeps its
communicator unless both said "done", and a rank that leaves keeps the
notices MPI has not sent yet, with their buffers.

Rank 1 of 3 runs here (prev 0, next 2); its neighbours are scripted
(`strict_comm.ScriptedMPI`), on one thread: a wait that could never end
raises HazardError instead of hanging.

    .venv/bin/python -m pytest tests/mpi/test_notices.py -q
"""

import numpy as np
import pytest

from mpi_impl import notices
from mpi_impl.comm import RingComm
from mpi_impl.notices import FROM_NEXT, FROM_PREV
from mpi_impl.ranks import RingError
from strict_comm import ScriptedMPI


def block(value, n=4):
    return np.full(n, float(value)), np.array([value], dtype=np.int64)


def rank_1_of_3(**kwargs):
    mpi = ScriptedMPI(rank=1, size=3, **kwargs)
    return RingComm(mpi), mpi


def test_a_receive_waits_for_the_notice_of_the_rank_it_receives_from():
    ring_comm, mpi = rank_1_of_3()
    shift = ring_comm.start_shift(block(1), 1)
    mpi.notify(FROM_PREV, "RuntimeError: boom")         # rank 0, the sender, left; rank 2 is still there
    with pytest.raises(RingError, match=r"^rank 1: round 0: receiving the K/V block \(array 0 of 2\) from "
                                        r"rank 0 failed: rank 0 left the ring \(RuntimeError: boom\)$"):
        ring_comm.finish_shift(shift)


def test_a_send_waits_for_the_notice_of_the_rank_it_sends_to():
    ring_comm, mpi = rank_1_of_3(waits_complete_sends=False)
    shift = ring_comm.start_shift(block(1), 1)
    mpi.deliver(1, block(0))
    ring_comm.finish_shift(shift)
    mpi.notify(FROM_NEXT, "SystemExit: 3")               # rank 2 left before taking this rank's block
    with pytest.raises(RingError, match=r"sending the K/V block \(array 0 of 2\) to rank 2 failed: "
                                        r"rank 2 left the ring \(SystemExit: 3\)$"):
        ring_comm.close()


@pytest.mark.parametrize("left, name", [(FROM_PREV, "rank 0"), (FROM_NEXT, "rank 2")])
def test_close_hears_from_both_neighbours_and_names_the_one_that_left(left, name):
    ring_comm, mpi = rank_1_of_3()
    shift = ring_comm.start_shift(block(1), 1)
    mpi.deliver(1, block(0))
    ring_comm.finish_shift(shift)
    mpi.take()
    mpi.notify(left, "RuntimeError: late")
    with pytest.raises(RingError, match=rf"^rank 1: {name} left the ring \(RuntimeError: late\) before its end here$"):
        ring_comm.close()


class DupMPI(ScriptedMPI):
    made = freed = 0

    def Dup(self):
        self.made += 1
        return self

    def Free(self):
        self.freed += 1


@pytest.mark.parametrize("prev_said, next_said, freed", [("", "", 1), ("", "RuntimeError: x", 0),
                                                         ("RuntimeError: x", "", 0), (None, "", 0)])
def test_a_failed_call_frees_its_communicator_only_if_both_neighbours_said_done(prev_said, next_said, freed):
    mpi = DupMPI(rank=1, size=3)
    kept = len(notices.KEPT)
    with pytest.raises(ValueError):
        with RingComm.on(mpi):
            for tag, said in ((FROM_PREV, prev_said), (FROM_NEXT, next_said)):
                if said is not None:
                    mpi.notify(tag, said)
            raise ValueError("the step failed")
    assert (mpi.made, mpi.freed) == (1, freed)
    assert notices.KEPT[kept:] == ([] if freed else [mpi])
    del notices.KEPT[kept:]


def test_a_rank_that_leaves_keeps_the_notices_mpi_has_not_sent_and_their_buffers():
    told = list(notices._TOLD)
    ring_comm, mpi = rank_1_of_3(waits_complete_sends=False)
    ring_comm.leave(RuntimeError("gone"))
    kept = notices._TOLD[len(told):]
    assert len(kept) == 2                                # one to each neighbour, neither taken yet
    for request, buffer in kept:
        assert not request.Test()
        assert bytes(buffer).rstrip(b"\0").decode() == "RuntimeError: gone"
    sent = mpi.take()                                    # the neighbours take them: MPI read the kept buffers
    assert {bytes(b).rstrip(b"\0").decode() for b in sent.values()} == {"RuntimeError: gone"}
    other, _ = rank_1_of_3()
    other.leave(RuntimeError("again"))                   # the next failed call prunes those complete by then
    assert all(request is not r for r, _ in kept for request, _ in notices._TOLD)
    notices._TOLD[:] = told


def test_a_quiet_ring_waits_quietly_for_its_blocks_and_its_neighbours_notices(monkeypatch):
    """RingComm(quiet=True) (more ranks than cores): every wait, for a block, a
    send and each neighbour's notice at close, goes through the quiet wait
    (`mpi_impl.cores.wait_any` with quiet), none through MPI's spinning one."""
    from mpi_impl import comm as comm_module
    from mpi_impl.cores import wait_any
    waited = []

    def recording(requests, *, quiet):
        waited.append((quiet, tuple(requests)))
        return wait_any(requests, quiet=False)         # the scripted neighbours answer MPI's waits
    monkeypatch.setattr(notices, "wait_any", recording)
    monkeypatch.setattr(comm_module, "wait_any", recording)
    mpi = ScriptedMPI(rank=1, size=3)
    ring_comm = RingComm(mpi, quiet=True)
    shift = ring_comm.start_shift(block(1), 1)
    mpi.deliver(1, block(0))
    ring_comm.finish_shift(shift)
    mpi.take()
    notice_requests = set(ring_comm._notices._requests.values())
    ring_comm.close()
    assert waited and all(quiet for quiet, _ in waited)
    assert notice_requests <= {r for _, requests in waited for r in requests}    # close's waits for both notices
