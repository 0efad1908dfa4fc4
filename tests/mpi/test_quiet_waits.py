"""A rank told to wait quietly (`mpi_impl.notices.Notices(quiet=True)`, what
``--waits quiet`` and a crowded machine choose) waits by testing with a sleep
between tests, never in MPI's spinning wait: for a transfer, for a transfer
after its neighbour said "done", and for the neighbours' notices at the end.

One rank of three, its neighbours and MPI played by stand-in requests on one
thread: a request completes after a few tests; a spinning wait (``Waitany``,
``Wait``) is recorded and fails the test.

    .venv/bin/python -m pytest tests/mpi/test_quiet_waits.py -q
"""

import types

import pytest

from mpi_impl import cores
from mpi_impl.notices import DONE, FROM_PREV, Notices


class Request:
    """A request that completes on its `tests_left`-th test; spinning on it is recorded."""

    def __init__(self, log, name, tests_left=3):
        self.log, self.name, self.tests_left = log, name, tests_left

    def Test(self):
        self.tests_left -= 1
        return self.tests_left <= 0

    @staticmethod
    def Testany(requests):
        for i, r in enumerate(requests):
            if r.Test():
                return i, True
        return -1, False

    @staticmethod
    def Waitany(requests):
        requests[0].log.append(f"spun on {requests[0].name}")
        return 0

    def Wait(self):
        self.log.append(f"spun on {self.name}")


class Comm:
    """Rank 1 of 3: a notice receive from each neighbour, done after `notice_tests` tests."""

    def __init__(self, notice_tests):
        self.log, self.notice_tests, self.buffers = [], notice_tests, {}

    def Irecv(self, buf, source, tag):
        buf[:] = 0                               # an empty notice: DONE
        return Request(self.log, f"notice {tag}", self.notice_tests)


@pytest.fixture
def pauses(monkeypatch):
    """The sleeps of the quiet waits, recorded instead of slept."""
    slept = []
    monkeypatch.setattr(cores, "time", types.SimpleNamespace(sleep=slept.append))
    return slept


def test_a_transfer_after_the_neighbours_done_is_waited_for_quietly(pauses):
    comm = Comm(notice_tests=1)                  # the neighbour's "done" is there at the first test
    notices = Notices(comm, prev=0, next=2, quiet=True)
    transfer = Request(comm.log, "the K/V block", tests_left=5)
    notices.wait(transfer, 0)
    assert notices._said[FROM_PREV] == DONE and transfer.tests_left <= 0
    assert comm.log == [] and len(pauses) >= 3, (comm.log, pauses)


def test_a_transfer_before_any_notice_is_waited_for_quietly(pauses):
    comm = Comm(notice_tests=100)
    notices = Notices(comm, prev=0, next=2, quiet=True)
    notices.wait(Request(comm.log, "the K/V block", tests_left=4), 2)
    assert comm.log == [] and len(pauses) >= 3


def test_the_end_waits_for_both_notices_quietly(pauses):
    comm = Comm(notice_tests=4)
    notices = Notices(comm, prev=0, next=2, quiet=True)
    assert notices.end(0) is None and notices.end(2) is None
    assert comm.log == [] and len(pauses) >= 3 and notices.all_done()


def test_a_rank_told_to_spin_spins():
    """The stand-in sees a spinning wait: what the tests above would catch."""
    comm = Comm(notice_tests=1)
    notices = Notices(comm, prev=0, next=2, quiet=False)
    notices.wait(Request(comm.log, "the K/V block"), 0)
    assert comm.log == ["spun on the K/V block"]
