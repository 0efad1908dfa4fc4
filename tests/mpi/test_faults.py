"""Fault injection under real MPI (tests/support/mpi/fault_worker.py): an exception on
one rank before, during or after the ring, a rank that exits (and one that
leaves with sys.exit(0), which its neighbours name), a transfer that fails,
ranks that disagree on each agreed field, a sub-communicator, one slow rank. Each job must end by itself (never by the launcher's time limit) with a
message naming the rank and the cause and a non-zero exit, or, for the slow
rank, with the right answer.

No assertion is on a duration: MPIEXEC_TIMEOUT is generous, so that a loaded
machine passes, and a job that hangs instead of ending is caught by the
launcher's time-limit message.

    .venv/bin/python -m pytest tests/mpi/test_faults.py -q
"""

import re

import pytest

from test_mpi import FAULT_DEADLINE_S, MPIEXEC, WORKERS, ended_by_itself, mpirun

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")

WORKER = str(WORKERS / "fault_worker.py")


def launch(mode, n=3, mpi4py_run=True):
    proc, _ = mpirun(n, WORKER, mode, mpi4py_run=mpi4py_run, timeout=FAULT_DEADLINE_S)
    output = proc.stdout + proc.stderr
    # (MPICH's proxy then also prints an assertion, "HYD_pmcd_pmip_control_cmd_cb ...
    # assert (!closed)": the time limit's kill closed its socket, not the cause of the hang)
    assert ended_by_itself(output), f"{mode}: the job hung:\n{output}"
    return proc, output


@pytest.mark.parametrize("mode, message, done", [
    # a ring that has not started: the others wait in its agreement check
    ("before", "RuntimeError: injected failure on rank 1 before the ring", []),
    # during the ring: the rank's name is put in front of the error's own message
    ("raise-last", "RuntimeError: rank 1: injected failure in round 2", []),
    ("raise-backward", "RuntimeError: rank 1: injected failure in round 1 of the backward", []),
    # after the ring (every rank through it): the job still fails
    ("after", "RuntimeError: injected failure on rank 1 after the ring", [0, 1, 2]),
])
def test_exception_on_one_rank_ends_the_job(mode, message, done):
    """`done`: the ranks that get through the ring (the others wait for rank 1's blocks)."""
    proc, output = launch(mode)
    assert proc.returncode != 0, output
    assert message in output, output
    for rank in range(3):
        said = f"rank {rank}: ring done" in output
        assert said == (rank in done), f"rank {rank} through the ring: {said}\n{output}"


def test_failed_transfer_names_rank_round_neighbour_and_transfer():
    """A real MPI error (a message larger than its receive buffer) on rank 0's
    receive from rank 2 in round 2 becomes a RingError saying so."""
    proc, output = launch("truncate")
    assert proc.returncode != 0, output
    assert "RingError: rank 0: round 2: receiving the K/V block (array 0 of 1) from rank 2 failed: MPI error:" \
        in output, output


def test_rank_exiting_ends_the_job():
    """Rank 1 vanishes in round 1: the job ends, non-zero. Its neighbours either
    see the failed transfer (and then name rank 1, the round and the block) or
    are ended by the launcher first; which comes first is up to the MPI."""
    proc, output = launch("exit")
    assert proc.returncode != 0, output
    assert "rank 1: exiting in round 1" in output, output
    assert "rank 2: finished without error" not in output, output
    for line in output.splitlines():
        if "RingError" in line:     # rank 0 sends to rank 1, rank 2 receives from it
            assert re.search(r"RingError: rank (0|2): round \d: (sending the .* to|receiving the .* from) "
                             r"rank 1 failed", line), line


def test_neighbour_that_left_is_named():
    """Rank 1 calls sys.exit(0) in round 1 (a clean exit: no launcher reports
    it), with 256 KiB arrays in flight: a neighbour says that rank 1 left the
    ring, and why, and the job ends non-zero (neither hangs in the next
    collective nor reports MPI's bare "Other MPI error")."""
    proc, output = launch("leave")
    assert proc.returncode != 0, output
    assert "rank 1: leaving in round 1" in output, output
    # in a transfer with rank 1, or at the end of the call (its transfers with rank 1 done)
    named = re.findall(r"RingError: rank [02]: (?:round \d: (?:sending the .* to|receiving the .* from) rank 1 "
                       r"failed: )?rank 1 left the ring \(SystemExit: 0\)", output)
    assert named, output


def test_a_failed_call_leaves_nothing_for_the_next():
    """A call that failed while a neighbour's "done" was on its way keeps its
    communicator: in the next call, a neighbour that leaves is named (with the
    first call's communicator freed, MPICH gave its context to the second, whose
    notice receive took the late "done", and the job hung)."""
    proc, output = launch("again", n=2)
    assert proc.returncode != 0, output
    assert "rank 1: first call: ValueError" in output and "rank 0: leaving the second call" in output, output
    assert re.search(r"RingError: rank 1: round 0: receiving the K/V block \(array 0 of 1\) from rank 0 failed: "
                     r"rank 0 left the ring \(SystemExit: 0\)", output), output


def test_disagreement_on_each_agreed_field():
    """For each field that must agree, rank 1 calls the ring differently: every
    rank raises "ranks disagree on <field>" (and the job carries on to the next)."""
    proc, output = launch("disagree", mpi4py_run=False)
    assert proc.returncode == 0, output
    for field in ("kind", "q", "k", "dtype", "layout", "causal", "scale", "tile_size", "trace", "lse"):
        for rank in range(3):
            assert f"rank {rank}: {field}: ranks disagree on {field}: rank 0 " in output, \
                f"rank {rank} did not refuse a disagreement on {field}:\n{output}"


def test_sub_communicator_names_its_ranks():
    """The ring on world ranks 1..3: messages name ranks of that communicator and say so."""
    proc, output = launch("subcomm", n=4)
    assert proc.returncode != 0, output
    for world_rank in (1, 2, 3):
        assert f"world rank {world_rank}: ranks of the 3-rank communicator disagree on causal" in output, output
    assert "RuntimeError: rank 1 of the 3-rank communicator (world rank 2): injected failure in round 0" \
        in output, output


def test_slow_rank_gives_the_right_answer():
    """Rank 1 sleeps in round 0 of both passes: the others wait, nothing breaks."""
    proc, output = launch("slow")
    assert proc.returncode == 0, output
    assert "rank 0: correct" in output, output
    assert output.count("finished without error") == 3, output
